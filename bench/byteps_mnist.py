"""BytePS's MNIST example, ported (tests/python/ported_byteps_mnist.py), under
torch DDP, every hemiola schedule and every parameter-server consistency,
with and without a straggler: what an epoch-based script gains from asynchrony, and what
``hemiola.ps.SharedBatchSampler`` adds.

    python bench/byteps_mnist.py                       # 3 runs, 20 epochs, 2 workers
    python bench/byteps_mnist.py --variants bsp eager eager+shared --runs 5

2 workers (plus 1 server for the parameter-server ones) on loopback;
run r uses the example's ``--seed`` 42 + r (the initial model and dropout);
with ``--slow-s`` the last worker sleeps that long after each batch (about 2x
a batch at the default). ``+shared`` replaces ``DistributedSampler`` with
``SharedBatchSampler``. Reported per variant over `--runs` runs: worker 0's
training time (test passes included, as the script runs them), the final
test accuracy the workers averaged, and the batches each worker trained.
Writes OUT/byteps_mnist.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import mean
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))

import ported_byteps_mnist  # noqa: E402  (the port lives beside its test)

from hemiola.bench.record import DEFAULT_OUT, write_lines  # noqa: E402

VARIANTS = ("ddp", "wfbp", "priority", "decoupled", "bsp", "asp", "eager", "asp+shared",
            "eager+shared")


def run(variant: str, epochs: int, slow_s: float, seed: int) -> dict[str, Any]:
    kind, _, shared = variant.partition("+")
    workers = ported_byteps_mnist.run_workers(kind, epochs, slow_s, shared == "shared", seed,
                                            timeout_s=600)
    return {"variant": variant, "epochs": epochs, "slow_s": slow_s, "seed": seed,
            "seconds": workers[0]["seconds"],
            "final_accuracy": workers[0]["tests"][-1]["accuracy"],
            "batches": [sum(w["batches"]) for w in workers]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--slow-s", type=float, nargs="+", default=[0.0, 0.01])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    plan = [(s, v, r) for s in args.slow_s for v in args.variants for r in range(args.runs)]
    rows = [run(v, args.epochs, s, ported_byteps_mnist.SEED + r)
            for s, v, r in tqdm(plan, desc="byteps mnist", unit="run")]
    path = write_lines(args.out / "byteps_mnist.jsonl", rows)
    print(f"\nBytePS's MNIST example (digits), 2 workers, {args.epochs} epochs, "
          f"{args.runs} runs: mean [min, max]")
    print(f"{'straggler':>10} {'variant':>13} {'seconds':>20} {'final acc %':>20} "
          f"{'batches (w0, w1)':>18}")
    for s in args.slow_s:
        for v in args.variants:
            mine = [r for r in rows if r["variant"] == v and r["slow_s"] == s]
            secs = [r["seconds"] for r in mine]
            acc = [100 * r["final_accuracy"] for r in mine]
            batches = [round(mean(r["batches"][i] for r in mine)) for i in range(2)]
            print(f"{s * 1000:>8.0f}ms {v:>13} "
                  f"{mean(secs):6.2f} [{min(secs):.2f}, {max(secs):.2f}] "
                  f"{mean(acc):6.1f} [{min(acc):.1f}, {max(acc):.1f}] "
                  f"{str(tuple(batches)):>18}")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
