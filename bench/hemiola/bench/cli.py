"""``hemiola bench SUITE [options]``: every suite of :mod:`hemiola.bench`."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

#: suite -> one line of help; the module hemiola.bench.<suite> has
#: ``add_arguments(parser)`` and ``run(args) -> int``.
SUITES = {
    "speed": "iteration time against DDP and its compression hooks, over a limited link",
    "memory": "peak resident memory per parameter against DDP and FSDP2, at 2 and 4 ranks",
    "convergence": "every schedule trained to the end on the same tasks and seeds",
    "streaming": "DiLoCo-style training (hemiola streaming, torchft) against DDP, over a slow link",
    "horizon": "streaming at a horizon: 3000 steps of a 10M model, K replicas, 95% intervals",
    "groups": "streaming's replica groups: sites of several ranks joined by a slow link",
    "elastic": "elastic streaming: replicas killed at random steps and restarted",
    "elastic_torchft": "the same kills and restarts under torchft's Manager and DiLoCo",
    "ps": "the parameter server's schemes with a straggler",
    "cluster": "LWF-κ and Ada-SRSF against first-fit and SRSF in the event simulator",
    "advise": "hemiola advise's predicted time against the time of its choice (root)",
    "report": "the tables of docs/benchmarks.md regenerated from result lines",
}


def _run(args: argparse.Namespace) -> int:
    from hemiola.bench.netlab import NetlabError

    module = importlib.import_module(f"hemiola.bench.{args.suite}")
    try:
        return int(module.run(args) or 0)
    except NetlabError as e:
        print(f"hemiola bench {args.suite}: a rate-limited link needs network namespaces: {e}. "
              "Run as root, or measure without a limit (hemiola bench speed --rates none).")
        return 2


def register(commands: Any) -> None:
    """Adds ``bench`` and its suites to the ``hemiola`` command's sub-parsers.
    A suite's module is imported only to build its options (each is light at
    import; torch is imported where a suite runs)."""
    bench = commands.add_parser("bench", help="the benchmarks, each against its baselines",
                                description=__doc__)
    suites = bench.add_subparsers(dest="suite", metavar="SUITE")
    suites.required = True
    for name, summary in SUITES.items():
        module = importlib.import_module(f"hemiola.bench.{name}")
        parser = suites.add_parser(name, help=summary, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parser)
        parser.set_defaults(run=_run)
