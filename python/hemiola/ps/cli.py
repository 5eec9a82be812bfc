"""``hemiola ps-server``: run this rank of a torchrun job as a parameter server.

Server machines run, for example::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 ... -m hemiola ps-server --num-servers 2

while worker machines run the training script (which calls ``hemiola.ps.wrap``
with the same ``num_servers`` and consistency). Workers choose the staleness
rule and the partitioning; they tell the servers. A job across machines needs
``HEMIOLA_JOB_TOKEN``, the same secret on every rank (the servers refuse
connections without it, and every rank refuses to start without it); a job on
one machine makes its own (docs/ps.md, "Network exposure").
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from hemiola.ps.config import CONSISTENCIES, PSConfig


def _run(args: argparse.Namespace) -> int:
    from hemiola.ps.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = PSConfig(consistency=args.consistency, num_servers=args.num_servers,
                      staleness_bound=args.staleness_bound, timeout_s=args.timeout_s,
                      snapshot_dir=args.snapshot_dir, snapshot_every_s=args.snapshot_every_s,
                      restore=args.restore, check_finite=not args.no_check_finite)
    serve(config)
    return 0


def register(commands: Any) -> None:
    p = commands.add_parser("ps-server", help="serve as a parameter server under torchrun",
                            description=__doc__.split("\n\n")[0])
    p.add_argument("--num-servers", type=int, default=1,
                   help="the first N ranks of the job are servers (default 1)")
    p.add_argument("--consistency", choices=CONSISTENCIES, default="bsp")
    p.add_argument("--staleness-bound", type=int, default=2, help="ssp bound s (default 2)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--snapshot-dir", default=None, help="where to write server-<i>.snap")
    p.add_argument("--snapshot-every-s", type=float, default=0.0,
                   help="snapshot periodically (0: only when a worker asks)")
    p.add_argument("--restore", action="store_true", help="start from the snapshots")
    p.add_argument("--no-check-finite", action="store_true",
                   help="apply gradients holding NaN or infinity instead of refusing them")
    p.set_defaults(run=_run)
