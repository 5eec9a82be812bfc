"""One replica of an elastic streaming run, as its own process (the elastic
tests and ``hemiola bench elastic`` start several).

``python elastic_worker.py '<json>'`` (or under ``torchrun``: a replica
group of several ranks; ``die_rank`` says which of them ``die_at`` kills):
keys ``coordinator``, ``name``, ``index`` (which data it sees: batch ``(index, step)``), ``steps``,
``sync_every``, ``fragments``, ``overlap``, ``out`` (where to write the
result as JSON), and optionally ``die_at`` (SIGKILL itself right after that
inner step) and ``step_s`` (seconds of sleep per step, to stand for
computation), ``save_at`` and ``save_to`` (a checkpoint of the model and
the optimizer after that step) and ``load`` (one to start from). The
result: counts, membership changes, a SHA-256 of the shared copy and outer
momentum, and the final parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import hemiola


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index * 100003 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


LR = 0.05


def main() -> None:
    args = json.loads(sys.argv[1])
    # Under torchrun the launch is one replica group of several ranks: each
    # rank its own batches, its own result file.
    rank = int(os.environ.get("RANK", "0"))
    if "RANK" in os.environ:
        args["index"] = args["index"] * 100 + rank
        args["out"] = args["out"].replace(".json", f"-{rank}.json")
        if args.get("die_at") and rank != args.get("die_rank", 0):
            args["die_at"] = None
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    wrapped, optimizer = hemiola.wrap(
        model, optimizer, schedule="streaming", sync_every=args["sync_every"],
        fragments=args["fragments"], overlap=args["overlap"],
        coordinator=args["coordinator"], group_name=args["name"], timeout_s=60.0)
    if args.get("load"):
        state = torch.load(args["load"])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    started = time.monotonic()
    while (step := int(wrapped.stats()["inner_steps"]) + 1) <= args["steps"]:
        x, y = batch(args["index"], step)
        loss = F.mse_loss(wrapped(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.get("save_at") == step:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       args["save_to"])
        if args.get("die_at") == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.get("step_s"):
            time.sleep(args["step_s"])
    wrapped.synchronize()
    streamer = wrapped._streamer
    digest = hashlib.sha256()
    for f in range(len(streamer.fragments())):
        for view in wrapped._views(f):
            digest.update(view.view(torch.uint8).numpy().tobytes())
    elastic = wrapped._elastic
    result = {
        "name": args["name"], "stats": wrapped.stats(), "seconds": time.monotonic() - started,
        "shared_sha256": digest.hexdigest(),
        "joined_at_step": elastic.joined_at_step,
        "recoveries": [vars(r) for r in elastic.recoveries],
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
    }
    with open(args["out"], "w") as f:
        json.dump(result, f)
    elastic.close()


if __name__ == "__main__":
    main()
