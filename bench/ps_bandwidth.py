"""Parameter-server iteration time over a real, rate-limited network: does
``eager`` (pull and push both under computation) beat ``asp`` and ``bsp``?

    python bench/ps_bandwidth.py                     # 1 Gbit/s, 1 server + 2 workers
    python bench/ps_bandwidth.py --servers 2         # 2 servers: communication ~ computation

Needs root. `--servers` + `--workers` network namespaces joined through veth
pairs limited by ``tc tbf`` (hemiola.bench.netlab), one process in each, every
process binding its veth (the servers are the first ranks). The model
is hemiola.bench.speed's MLP at width 1024, 4.2M parameters (16.8 MB of float32
gradients and as many of parameters) with its batch (896), so on the
development machine its compute alone takes about as long as moving it once
at 1 Gbit/s. Each worker first times the bare model (compute alone), then
trains through the parameter server for `--iterations` iterations after 3 of
warm-up, for each consistency model in turn (one job per model).

Every iteration, each worker's gradients go in to the servers and its
parameters come back out: each server's link carries W x 16.8 MB / S in each
direction and each worker's 16.8 MB. The busiest link's time is the floor of
an iteration, and max(compute, that) is the lower bound reported. Worker 0's median per
iteration is reported, and its median over the second half of the iterations
(``eager`` learns which pulls to send ahead in the first few). Writes
bench/results/ps_bandwidth.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from statistics import median
from typing import Any

import torch

from hemiola.bench.netlab import Network, parse_result, print_result
from hemiola.bench.record import DEFAULT_OUT, split_ahead, write_lines
from hemiola.bench.speed import MLP_BATCH, make_model

SCHEMES = ("bsp", "asp", "eager")


def rank_main(config: dict[str, Any]) -> dict[str, Any] | None:
    """One process of one job (RANK etc. and GLOO_SOCKET_IFNAME in the environment)."""
    import hemiola.ps

    torch.set_num_threads(1)
    consistency, fraction = split_ahead(config["scheme"])
    ps_config = hemiola.ps.PSConfig(consistency=consistency, num_servers=config["servers"],
                                    timeout_s=600, ahead_fraction=fraction)
    role = hemiola.ps.role(config["servers"])
    if role.is_server:
        hemiola.ps.serve(ps_config, role)
        return None
    model, x, y = make_model("mlp", config["batch"], mlp_width=1024)
    loss_fn = torch.nn.CrossEntropyLoss()

    def compute_alone() -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            model.zero_grad()
            loss_fn(model(x), y).backward()
            times.append(time.perf_counter() - start)
        return median(times[1:])

    compute = compute_alone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    wrapped, optimizer = hemiola.ps.wrap(model, optimizer, ps_config)
    times = []
    for i in range(3 + config["iterations"]):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(wrapped(x), y).backward()
        optimizer.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
    staleness = wrapped.staleness()
    ahead_names = set(wrapped.pulled_ahead())
    ahead_share = (sum(p.numel() for n, p in model.named_parameters() if n in ahead_names)
                   / sum(p.numel() for p in model.parameters()))
    wrapped.close()
    return {"worker": role.worker_index, "compute_ms": 1e3 * compute,
            "iteration_ms": 1e3 * median(times),
            "second_half_ms": 1e3 * median(times[len(times) // 2:]),
            "mean_staleness": staleness["mean"],
            "ahead_share": ahead_share,
            "params": sum(p.numel() for p in model.parameters())}


def run_job(net: Network, scheme: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    config = {"scheme": scheme, "batch": args.batch, "iterations": args.iterations,
              "servers": args.servers}
    outputs = net.run_ranks([sys.executable, __file__, "--rank", json.dumps(config)], port,
                            args.timeout_s)
    text = outputs[args.servers]  # worker 0
    return dict(parse_result(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--batch", type=int, default=MLP_BATCH)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES),
                        help="consistency models; eager@F: eager pulling the front F of the "
                             "bytes ahead (PSConfig.ahead_fraction)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        print_result(rank_main(json.loads(args.rank)))
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts the store
    rate_bits = float(args.rate.lower().replace("gbit", "e9").replace("mbit", "e6"))
    rows = []
    with Network(args.servers + args.workers, args.rate) as net:
        for k, scheme in enumerate(args.schemes):
            result = run_job(net, scheme, args, port=29600 + k)
            link_ms = (1e3 * max(1.0, args.workers / args.servers) * result["params"] * 4 * 8
                       / rate_bits)
            bound = max(result["compute_ms"], link_ms)
            rows.append({"rate": args.rate, "servers": args.servers, "workers": args.workers,
                         "scheme": scheme, **result,
                         "busiest_link_ms": link_ms, "lower_bound_ms": bound})
            print(f"{scheme:>6}: {result['iteration_ms']:7.1f} ms/iteration "
                  f"({result['second_half_ms']:.1f} over the second half; "
                  f"compute alone {result['compute_ms']:.1f}, busiest link {link_ms:.1f}, "
                  f"bound {bound:.1f}, x{result['iteration_ms'] / bound:.2f}; "
                  f"mean staleness {result['mean_staleness']:.2f}, pulled ahead "
                  f"{100 * result['ahead_share']:.0f}% of the bytes)", flush=True)
    path = write_lines(DEFAULT_OUT / "ps_bandwidth.jsonl", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
