"""Elastic ``streaming``: replicas killed at random inner steps and restarted.

    hemiola bench elastic                    # 3 groups, 10 kills, ByteLM, loopback
    hemiola bench elastic --kills 3 --steps 300 --task digits   # a quick look

A coordinator (hemiola.elastic) runs in this process; ``--groups`` replicas
run as processes of their own (``python -m hemiola.bench.elastic --worker``),
each training ``--task`` on its own batches towards the run's inner step
``--steps``. ``--kills`` times, one group SIGKILLs itself right after an
inner step (at least ``--in-flight`` of them while a fragment it sent is in
flight: sent, not landed), and is started again at once under the same name;
it joins at a sync and is handed the shared copy. The kill steps are drawn
from ``--seed``.

Printed and written (OUT/NAME.jsonl): per failure, the inner steps each
survivor lost (the steps it took more than the run's length less the step it
started at: 0 when nothing was rolled back or redone), the survivors' stall
(from the failed average to training again), whether the failed sync's
average was kept or averaged again; per join, the steps from the joiner's
admission to its first send; and at the end whether every live replica's
shared copy and outer momentum are bitwise equal (SHA-256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hemiola.bench.record import DEFAULT_OUT, write_lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--in-flight", type=int, default=3,
                        help="kills while a fragment is in flight (sent, not landed)")
    parser.add_argument("--task", default="lm", help="a convergence task (default lm: ByteLM)")
    parser.add_argument("--steps", type=int, default=1500,
                        help="the run's inner steps (long enough for every kill and restart)")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--overlap", type=int, default=3)
    parser.add_argument("--rate", default="none",
                        help="the link of each group (tc tbf rate, e.g. 100mbit; namespaces, "
                             "root), or 'none': loopback")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="the coordinator's failure-detection timeout (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--name", default="elastic")
    parser.add_argument("--worker", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.rate == "none":
        return _run(args, _Loopback(args))
    from hemiola.bench.netlab import Network

    with Network(args.groups + 1, rate=args.rate) as net:
        return _run(args, _Namespaces(args, net))


class _Loopback:
    """The coordinator in this process, the groups on this machine's loopback."""

    def __init__(self, args: argparse.Namespace) -> None:
        from hemiola.elastic.coordinator import Coordinator

        self._coordinator = Coordinator("127.0.0.1", 0, min_replicas=1, timeout_s=args.timeout,
                                        start_replicas=args.groups)
        self._coordinator.start()
        self.address = f"127.0.0.1:{self._coordinator.address[1]}"

    def history(self) -> list[Any]:
        return list(self._coordinator.history)

    def popen(self, group: int, command: list[str], log: Any) -> Any:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def close(self) -> None:
        self._coordinator.close()


class _Namespaces:
    """Every group in a network namespace of its own behind a `--rate` link
    (:mod:`hemiola.bench.netlab`, root), the coordinator in one more: its
    ``hemiola coordinator`` process's epochs read from its log."""

    PORT = 29400

    def __init__(self, args: argparse.Namespace, net: Any) -> None:
        import os
        import secrets
        import threading

        self._net = net
        self._env = {"HEMIOLA_JOB_TOKEN": os.environ.get("HEMIOLA_JOB_TOKEN")
                     or secrets.token_hex(16)}
        self._history: list[Any] = []
        self._proc = net.popen(0, [sys.executable, "-m", "hemiola", "coordinator", "--host",
                                   net.addrs[0], "--port", str(self.PORT), "--min-replicas", "1",
                                   "--start-replicas", str(args.groups), "--timeout",
                                   str(args.timeout)],
                               env=self._env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.address = f"{net.addrs[0]}:{self.PORT}"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        import re

        epoch = re.compile(r"coordinator: epoch (\d+): \d+ replicas (\[.*?\])")
        for line in self._proc.stdout:
            print(line, end="", file=sys.stderr)
            m = epoch.search(line)
            if m:
                self._history.append((int(m.group(1)), json.loads(m.group(2).replace("'", '"')),
                                      line.strip()))

    def history(self) -> list[Any]:
        return list(self._history)

    def popen(self, group: int, command: list[str], log: Any) -> Any:
        env = {**self._env, "GLOO_SOCKET_IFNAME": self._net.ifaces[group + 1]}
        return self._net.popen(group + 1, command, env=env, stdout=log,
                               stderr=subprocess.STDOUT)

    def close(self) -> None:
        self._proc.terminate()


def _run(args: argparse.Namespace, place: Any) -> int:
    rng = random.Random(args.seed)
    # One kill at a time, each after the last victim is back in the run:
    # which group, after how many of its steps from then, and whether while
    # a fragment is in flight.
    # With overlap 0 a fragment is sent and landed inside one step: between
    # steps nothing is in flight, so every kill is between syncs.
    in_flight = args.in_flight if args.overlap > 0 else 0
    if in_flight < args.in_flight:
        print("overlap 0: no fragment is in flight between steps, so every kill is between "
              "syncs", file=sys.stderr)
    plans = [{"after": rng.randint(5, 40), "in_flight": k < in_flight}
             for k in range(args.kills)]
    rng.shuffle(plans)
    common = {"coordinator": place.address, "task": args.task,
              "steps": args.steps, "sync_every": args.sync_every,
              "fragments": args.fragments, "overlap": args.overlap, "seed": args.seed}
    work = Path(tempfile.mkdtemp(prefix="hemiola-elastic-"))
    procs: dict[int, tuple[Any, Path]] = {}
    outputs: list[Path] = []
    started = time.monotonic()

    def start(group: int) -> None:
        out = work / f"g{group}-{len(outputs)}.json"
        outputs.append(out)
        config = {**common, "name": f"g{group}", "index": group, "out": str(out),
                  "arm": str(work / f"arm-g{group}.json")}
        log = open(work / f"{out.stem}.log", "w")
        procs[group] = (place.popen(
            group, [sys.executable, "-m", "hemiola.bench.elastic", "--worker",
                    json.dumps(config)], log), out)

    # The next kill waits for an epoch after the last one's with every group in it.
    epoch_at_kill = 0

    def everyone_in() -> bool:
        history = place.history()
        return (bool(history) and history[-1][0] > epoch_at_kill
                and len(history[-1][1]) == args.groups)

    for group in range(args.groups):
        start(group)
    kills = kills_in_flight = 0
    armed: int | None = None
    armed_plan: dict[str, Any] = {}
    try:
        while procs:
            time.sleep(0.1)
            if armed is None and plans and everyone_in():
                armed = rng.randrange(args.groups)
                armed_plan = plans.pop()
                (work / f"arm-g{armed}.json").write_text(json.dumps(armed_plan))
            for group, (proc, out) in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[group]
                log_text = out.with_suffix(".log").read_text()
                if code == -9:
                    kills += 1
                    kills_in_flight += bool(armed_plan["in_flight"])
                    armed = None
                    history = place.history()
                    epoch_at_kill = history[-1][0] if history else 0
                    when = "in flight" if armed_plan["in_flight"] else "between syncs"
                    print(f"[{time.monotonic() - started:6.1f} s] kill {kills}: group g{group} "
                          f"killed itself ({when}); starting it again", file=sys.stderr,
                          flush=True)
                    start(group)
                elif code != 0 and "no live member left" in log_text:
                    print(f"group g{group} came back after the run had ended (nothing to join)",
                          file=sys.stderr)
                elif code != 0:
                    raise RuntimeError(f"group g{group} failed ({code}): see "
                                       f"{out.with_suffix('.log')}")
    finally:
        place.close()
    results = [json.loads(p.read_text()) for p in outputs if p.exists()]
    rows = summarise(results, place.history(), kills, kills_in_flight, args)
    write_lines(args.out / f"{args.name}.jsonl", rows)
    print(f"logs and results: {work}", file=sys.stderr)
    return 0


def summarise(results: list[dict[str, Any]], history: list[Any], kills: int,
              kills_in_flight: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    failures = [r for res in results for r in res["recoveries"] if r["what"] != "admit"]
    admits = [r for res in results for r in res["recoveries"] if r["what"] == "admit"]
    lost = [res["executed"] - (res["inner_steps"] - (res["joined_at_step"] or 0))
            for res in results]
    contribute = [res["first_send_after"] for res in results if res["joined_at_step"] is not None]
    finals = {res["shared_sha256"] for res in results if res["finished"]}
    row = {
        "suite": "elastic", "task": args.task, "groups": args.groups, "kills": kills,
        "kills_in_flight": kills_in_flight,
        "steps": args.steps, "sync_every": args.sync_every, "fragments": args.fragments,
        "overlap": args.overlap, "timeout_s": args.timeout, "rate": args.rate,
        "epochs": len(history),
        "survivor_failures": len(failures),
        "kept": sum(r["what"] == "failure" for r in failures),
        "averaged_again": sum(r["what"] != "failure" for r in failures),
        "steps_lost_max": max(lost) if lost else None,
        "stall_s_max": max((r["stall_s"] for r in failures), default=None),
        "stall_s_mean": (sum(r["stall_s"] for r in failures) / len(failures)) if failures
        else None,
        "admit_stall_s_max": max((r["stall_s"] for r in admits), default=None),
        "steps_to_contribute_max": max(contribute) if contribute else None,
        "fragment_period": args.sync_every // args.fragments,
        "finished_replicas": sum(res["finished"] for res in results),
        "final_shared_bitwise_equal": len(finals) == 1,
    }
    print(json.dumps(row, indent=1))
    if kills < args.kills:
        print(f"only {kills} of {args.kills} kills happened before the run's {args.steps} "
              "steps ended: give it more --steps", file=sys.stderr)
    return [row]


def worker(config: dict[str, Any]) -> None:
    """One replica: trains to the run's last step, or kills itself as planned."""
    import os
    import signal

    import torch

    import hemiola
    from hemiola.bench.tasks import TASKS

    torch.set_num_threads(1)
    task = TASKS[config["task"]]()
    torch.manual_seed(config["seed"])
    model = task.model()
    optimizer = task.optimizer(model)
    wrapped, optimizer = hemiola.wrap(
        model, optimizer, schedule="streaming", sync_every=config["sync_every"],
        fragments=config["fragments"], overlap=config["overlap"],
        coordinator=config["coordinator"], group_name=config["name"], timeout_s=120.0)
    streamer = wrapped._streamer
    elastic = wrapped._elastic
    x_all, y_all = task.epoch_samples(config["seed"], 0)
    g = torch.Generator().manual_seed(config["seed"] * 1000 + config["index"])
    mine = torch.randperm(len(x_all), generator=g)
    die: dict[str, Any] | None = None
    armed_at = 0
    executed = 0
    syncs_at_start = streamer.syncs
    first_send_after = None

    def snapshot(finished: bool) -> None:
        # Written at every membership change too: a group killed later
        # leaves what it went through as a survivor.
        digest = hashlib.sha256()
        for f in range(len(streamer.fragments())):
            for view in wrapped._views(f):
                digest.update(view.view(torch.uint8).numpy().tobytes())
        result = {"name": config["name"], "executed": executed, "finished": finished,
                  "inner_steps": streamer.inner_steps, "joined_at_step": elastic.joined_at_step,
                  "first_send_after": first_send_after, "shared_sha256": digest.hexdigest(),
                  "stats": wrapped.stats(), "recoveries": [vars(r) for r in elastic.recoveries]}
        Path(config["out"]).write_text(json.dumps(result))

    seen = 0
    while (step := streamer.inner_steps + 1) <= config["steps"]:
        at = (step * task.batch_size) % max(1, len(mine) - task.batch_size)
        idx = mine[at:at + task.batch_size]
        optimizer.zero_grad()
        task.loss(wrapped, x_all[idx], y_all[idx]).backward()
        optimizer.step()
        executed += 1
        if first_send_after is None and (streamer.in_flight_fragment >= 0
                                         or streamer.syncs > syncs_at_start):
            first_send_after = executed
        if len(elastic.recoveries) != seen:
            seen = len(elastic.recoveries)
            snapshot(finished=False)
        if die is None and os.path.exists(config["arm"]):
            die = json.loads(Path(config["arm"]).read_text())
            os.remove(config["arm"])
            armed_at = executed
        if (die is not None and executed - armed_at >= die["after"]
                and (streamer.in_flight_fragment >= 0) == die["in_flight"]):
            os.kill(os.getpid(), signal.SIGKILL)
    wrapped.synchronize()
    snapshot(finished=True)
    elastic.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
