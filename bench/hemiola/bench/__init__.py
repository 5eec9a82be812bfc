"""The benchmarks as one tool: ``hemiola bench SUITE``.

Suites (each a module here, each writing JSON lines with an environment stamp
and median with p10-p90; :mod:`hemiola.bench.report` turns them into tables):

- ``speed``: iteration time over a rate-limited link or loopback, against the
  bare model, torch DDP, DDP with the fp16 and PowerSGD hooks, and FSDP2;
- ``memory``: peak resident memory of training per parameter, per rank,
  against torch DDP and FSDP2;
- ``convergence``: every schedule trained to the end on the same tasks;
- ``ps``: the parameter server with a straggler;
- ``cluster``: the cluster scheduler in the event simulator;
- ``advise``: ``hemiola advise``'s prediction against its measured choice;
- ``report``: the tables of docs/benchmarks.md regenerated from result lines.
"""
