"""Replica groups of ``streaming`` over a slow link between sites.

    hemiola bench groups                          # 2 sites of 2 ranks, 100 Mbit/s between them
    hemiola bench groups --rate none --steps 40   # loopback, a quick check

Each site is a network namespace holding ``--ranks`` ranks (they reach each
other inside it, off the link); the sites are joined by ``tc tbf``-limited
veth pairs (:mod:`hemiola.bench.netlab`, root). Every rank trains three
contenders on the same task, seed and batches, in alternating blocks of
``--block`` steps with a barrier before each:

- ``inside``: every inner step averaged inside the site (``wfbp`` over the
  site's ranks), nothing between sites: the time the sites' computation and
  their own link take, the floor streaming is held to;
- ``groups``: ``streaming`` with a replica per site (``replica_ranks`` left
  to its default: torchrun's ``LOCAL_WORLD_SIZE`` is the site's ranks);
- ``each``: ``streaming`` with every rank a replica (``replica_ranks=1``),
  what the run did before replica groups.

Per contender: ms per step (the slowest rank's), the bytes each site's link
sent per sync (its veth counter over the contender's blocks, divided by its
syncs) beside one fragment's coded bytes, the shared copies' largest
difference across all ranks at the end, rank 0's held-out loss, and the
syncs' work on rank 0's training thread (packing, the outer step, the merge:
``stats()["host_ms"]``) as a share of its training time. Writes OUT/NAME.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hemiola.bench.record import DEFAULT_OUT, write_lines

CONTENDERS = ("inside", "groups", "each")
#: bytes on the wire per float32 element (int8/int4: one float32 scale per
#: block of 256 beside the codes)
CODING_BYTES = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 256}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", default="100mbit",
                        help="the link between sites (tc tbf rate; 'none': loopback)")
    parser.add_argument("--sites", type=int, default=2, help="replica groups (default 2)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per site (default 2)")
    parser.add_argument("--task", default="lm", help="a convergence task (default lm: ByteLM)")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per contender")
    parser.add_argument("--block", type=int, default=40, help="steps per alternating block")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--overlap", type=int, default=5)
    parser.add_argument("--compression", default="int8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29700)
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--name", default="groups", help="results go to OUT/NAME.jsonl")


def run(args: argparse.Namespace) -> int:
    from hemiola.bench.netlab import Network, parse_result, run_ranks

    config = {k: getattr(args, k) for k in ("task", "steps", "block", "sync_every", "fragments",
                                            "overlap", "compression", "seed")}
    command = [sys.executable, "-m", "hemiola.bench.groups", json.dumps(config)]
    world, ranks = args.sites * args.ranks, args.ranks
    local = {"LOCAL_WORLD_SIZE": str(ranks)}
    print(f"hemiola bench groups: {args.sites} sites of {ranks} ranks, {args.rate} between "
          f"them, {args.steps} steps of each of {', '.join(CONTENDERS)}", flush=True)
    if args.rate == "none":
        import subprocess

        def start_lo(rank: int, env: dict[str, str], **kw: Any) -> Any:
            return subprocess.Popen(command, env={**os.environ, **env, **local}, text=True, **kw)

        outputs = run_ranks(start_lo, world, "127.0.0.1", ["lo"] * world, args.port,
                            args.timeout_s)
    else:
        with Network(args.sites, rate=args.rate) as net:
            def start(rank: int, env: dict[str, str], **kw: Any) -> Any:
                return net.popen(rank // ranks, command, env={**env, **local}, **kw)

            ifaces = [net.ifaces[r // ranks] for r in range(world)]
            outputs = run_ranks(start, world, net.addrs[0], ifaces, args.port, args.timeout_s)
    result = parse_result(outputs[0])
    rows = []
    for name in CONTENDERS:
        r = result["runs"][name]
        rows.append({"suite": "groups", "rate": args.rate, "sites": args.sites, "ranks": ranks,
                     "contender": name, **config, "params": result["params"],
                     "fragment_coded_bytes": result["fragment_coded_bytes"], **r})
    write_lines(args.out / f"{args.name}.jsonl", rows)
    print(f"{'contender':<9} {'ms/step':>8} {'x inside':>8} {'syncs':>6} "
          f"{'link bytes/sync/site':>21} {'x fragment':>10} {'shared spread':>13} "
          f"{'held-out':>8} {'sync host':>9}")
    inside = result["runs"]["inside"]["ms_per_step"]
    fragment = result["fragment_coded_bytes"]
    for row in rows:
        per_sync = row["link_bytes_per_sync"]
        print(f"{row['contender']:<9} {row['ms_per_step']:>8.1f} "
              f"{row['ms_per_step'] / inside:>8.3f} {row['syncs']:>6.0f} "
              f"{'-' if per_sync is None else f'{per_sync:,.0f}':>21} "
              f"{'-' if per_sync is None else f'{per_sync / fragment:.2f}':>10} "
              f"{'-' if row['shared_spread'] is None else row['shared_spread']:>13} "
              f"{row['heldout_loss']:>8.4f} {row['host_share']:>9.2%}")
    print(f"one fragment coded ({args.compression}): {fragment:,.0f} bytes; "
          f"results in {args.out / (args.name + '.jsonl')}")
    return 0


def worker(config: dict[str, Any]) -> dict[str, Any]:
    """One rank: the three contenders in alternating blocks."""
    import torch
    import torch.distributed as dist

    import hemiola
    from hemiola.bench.streaming_rank import tx_bytes
    from hemiola.bench.tasks import TASKS
    from hemiola.config import Config
    from hemiola.data_parallel import DataParallel
    from hemiola.distributed import new_subgroup_engines

    torch.set_num_threads(1)
    hemiola.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    task = TASKS[config["task"]]()
    seed, steps = config["seed"], config["steps"]
    streaming = {"sync_every": config["sync_every"], "fragments": config["fragments"],
                 "overlap": config["overlap"], "compression": config["compression"]}

    def build(name: str) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = task.model()
        optimizer = task.optimizer(model)
        if name == "inside":
            group, store, _, _ = new_subgroup_engines(ranks, 300.0)
            return DataParallel(model, Config(), group, store), optimizer
        extra = {"replica_ranks": 1} if name == "each" else {}
        return hemiola.wrap(model, optimizer, schedule="streaming", **streaming, **extra)

    runs = {name: build(name) for name in CONTENDERS}
    seconds = dict.fromkeys(CONTENDERS, 0.0)
    sent = dict.fromkeys(CONTENDERS, 0)
    x_all, y_all = task.epoch_samples(seed, 0)
    g = torch.Generator().manual_seed(seed)
    mine = torch.randperm(len(x_all), generator=g)[rank::world]
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = (step * task.batch_size) % max(1, len(mine) - task.batch_size)
        idx = mine[at:at + task.batch_size]
        return x_all[idx], y_all[idx]

    done = 0
    while done < steps:
        n = min(config["block"], steps - done)
        order = CONTENDERS if (done // config["block"]) % 2 == 0 else CONTENDERS[::-1]
        for name in order:
            model, optimizer = runs[name]
            dist.barrier()
            before = tx_bytes(iface)
            start = time.perf_counter()
            for step in range(done, done + n):
                x, y = batch(step)
                optimizer.zero_grad()
                task.loss(model, x, y).backward()
                optimizer.step()
            if hasattr(model, "synchronize"):
                model.synchronize()
            seconds[name] += time.perf_counter() - start
            after = tx_bytes(iface)
            if before is not None and after is not None:
                sent[name] += after - before
        done += n
        if rank == 0:
            print(f"{done}/{steps} steps of each contender", file=sys.stderr, flush=True)
    dist.barrier()
    slowest: list[Any] = [None] * world
    dist.all_gather_object(slowest, seconds)
    out: dict[str, Any] = {"runs": {}}
    for name in CONTENDERS:
        model, _ = runs[name]
        spread = None
        syncs, host = 0.0, 0.0
        if name != "inside":
            s = model._streamer
            s.wait_in_flight()
            shared = torch.cat([torch.frombuffer(s.shared_view(f), dtype=torch.float32)
                                for f in range(len(s.fragments()))])
            gathered = [torch.empty_like(shared) for _ in range(world)]
            dist.all_gather(gathered, shared)
            spread = max(float((t - gathered[0]).abs().max()) for t in gathered)
            syncs = float(model.stats()["syncs"])
            host = float(model.stats()["host_ms"])
        heldout = float("nan")
        if rank == 0:
            with torch.no_grad():
                heldout = task.evaluate(model.module)["heldout_loss"]
        out["runs"][name] = {
            "ms_per_step": 1e3 * max(s[name] for s in slowest) / steps,
            "syncs": syncs, "link_bytes": sent[name] if iface != "lo" else None,
            "link_bytes_per_sync": (sent[name] / syncs if iface != "lo" and syncs else None),
            "shared_spread": spread, "heldout_loss": heldout,
            # the syncs' work on the training thread, as a share of its time
            "host_share": host / (1e3 * seconds[name]) if seconds[name] else 0.0}
    params = [p for p in runs["inside"][0].module.parameters() if p.requires_grad]
    out["params"] = sum(p.numel() for p in params)
    out["fragment_coded_bytes"] = (out["params"] / config["fragments"]
                                   * CODING_BYTES[config["compression"]])
    return out


if __name__ == "__main__":
    from hemiola.bench.netlab import print_result

    result = worker(json.loads(sys.argv[1]))
    if int(os.environ["RANK"]) == 0:
        print_result(result)
