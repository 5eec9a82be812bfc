"""Elastic torchft: :mod:`hemiola.bench.elastic`'s kill/restart scenario under
torchft's fault tolerance (``torchft.local_sgd.DiLoCo``), the peer row to
hemiola's.

    python -m hemiola.bench.elastic_torchft                  # 3 groups, 10 kills, digits
    python -m hemiola.bench.elastic_torchft --kills 3 --steps 200   # a quick look

A ``LighthouseServer`` runs in this process (``min_replicas`` 1, so the run
goes on with the survivors; join and heartbeat timeouts ``--timeout``);
``--groups`` replica groups of one process each (``python -m
hemiola.bench.elastic_torchft --worker JSON``) each run a ``torchft.Manager``
(ProcessGroupGloo, ``min_replica_size`` 1, synchronous quorum, its own
TCPStore; operation timeout ``--timeout``) and ``DiLoCo`` around ``--task``'s
model and inner optimizer, with an outer SGD (``--outer-lr``,
``--outer-momentum``; by default lr 1, no momentum: plain averaging, hemiola's
default). ``--fragments`` 1 and ``--overlap`` 0 (the defaults) are torchft's
blocking DiLoCo; more fragments cut the model's parameters into that many
contiguous pieces of about equal size (torchft's Streaming DiLoCo,
``fragment_sync_delay`` = overlap), which runs on CPU without triton as long
as nothing is quantized.

``--rate`` (e.g. ``100mbit``; root) puts every group in a network namespace
of its own behind a ``tc tbf`` link of that rate (:mod:`hemiola.bench.netlab`,
as ``elastic --rate``), and the lighthouse in one more: torchft's
``torchft_lighthouse`` as a process there, its log in the work folder. Each
group's Manager, TCPStore, checkpoint server and Gloo (``GLOO_SOCKET_IFNAME``)
then use its namespace's address. ``none`` (the default): everything on this
machine's loopback, the lighthouse in this process.

Every group waits with its Manager up until all are, so the first quorum has
them all. ``--kills`` times, one group, armed through a file once the last
victim is back in the run (it has committed a sync with every group in the
quorum), SIGKILLs itself ``after`` (5 to 40, drawn from ``--seed``) of its own
inner steps from then; ``--in-flight`` of the kills while a sync it takes part
in is in progress: its all-reduce of the pseudo-gradients posted (quorum
formed), not yet waited for -- with overlap 0 inside the optimizer step that
syncs, right after posting, else at an inner step between the fragment's
prepare and its sync (where on a small model Gloo may well have landed it
already). The others at an inner step with nothing posted. A kill is left out
when fewer than ``after`` + 3 H inner steps of the run are left. The victim is
started again at once under the same name (torchft appends a UUID to the
replica id); it trains from its seed's parameters until its first quorum,
where the Manager heals it from a survivor: the ``load_state_dict`` and
``state_dict`` given to the Manager carry the model's state and the inner
optimizer's, DiLoCo's own carry its backup and outer optimizer.

Per group (a JSON file each, rewritten at each sync and before a kill): its
own executed inner steps, the run's inner step it healed at, every sync
(quorum id, participants, committed or not, time blocked), and per failure it
survived -- a sync whose commit failed ("failure": DiLoCo restores its
backup), or whose quorum lost a member ("shrink") -- the inner steps whose
progress was discarded, measured from the parameters (the restored fragment's
SHA-256 matched against the backups recorded at each commit; with fragments,
the steps of that fragment's progress), and the stall: the wall time blocked
in syncs from the failing one to the first sync committed without the dead
member. For a restarted group, the inner steps from its start to its first
committed sync (whose pseudo-gradient is the healer's: its own steps first
count at its next commit, ``own``). The row (OUT/NAME.jsonl) adds whether the
finished groups' shared copies (DiLoCo's backups after the last sync) are
bitwise equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hemiola.bench.record import DEFAULT_OUT, write_lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options (``elastic``'s, plus torchft's outer optimizer)."""
    parser.add_argument("--groups", type=int, default=3,
                        help="replica groups (one process, one rank each)")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--in-flight", type=int, default=3,
                        help="kills while a sync is in progress (all-reduce posted, not waited)")
    parser.add_argument("--task", default="digits",
                        help="a convergence task (default digits; lm: ByteLM)")
    parser.add_argument("--steps", type=int, default=600, help="the run's inner steps")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--fragments", type=int, default=1,
                        help="DiLoCo's model fragments (1: blocking DiLoCo)")
    parser.add_argument("--overlap", type=int, default=0,
                        help="torchft's fragment_sync_delay (inner steps a sync is in flight)")
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.0,
                        help="outer SGD momentum (Nesterov when > 0)")
    parser.add_argument("--rate", default="none",
                        help="the link of each group (tc tbf rate, e.g. 100mbit; namespaces, "
                             "root), or 'none': loopback")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="failure detection (s): the lighthouse's heartbeat and join "
                        "timeouts, the Manager's and Gloo's operation timeout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--name", default="elastic_torchft")
    parser.add_argument("--worker", help=argparse.SUPPRESS)


def _read(path: Path) -> dict[str, Any] | None:
    """A group's JSON file, or None while it is not there (written by rename)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run(args: argparse.Namespace) -> int:
    """The controller (or, with ``--worker``, one group); returns the exit status."""
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.sync_every % args.fragments or args.overlap >= args.sync_every // args.fragments:
        raise SystemExit("--sync-every must be a multiple of --fragments and "
                         "--overlap less than sync_every / fragments")
    work = Path(tempfile.mkdtemp(prefix="hemiola-elastic-torchft-"))
    if args.rate == "none":
        return _run(args, _Loopback(args), work)
    from hemiola.bench.netlab import Network

    with Network(args.groups + 1, rate=args.rate) as net:
        return _run(args, _Namespaces(args, net, work), work)


class _Loopback:
    """The lighthouse in this process, the groups on this machine's loopback."""

    def __init__(self, args: argparse.Namespace) -> None:
        # The lighthouse logs every quorum tick at INFO on this process's
        # stderr; the groups keep torchft's default logging (in their log files).
        self._env = dict(os.environ)
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft.coordination import LighthouseServer

        timeout_ms = int(args.timeout * 1000)
        self._lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1,
                                            join_timeout_ms=timeout_ms, quorum_tick_ms=100,
                                            heartbeat_timeout_ms=timeout_ms)
        self.address = self._lighthouse.address()

    def host(self, group: int) -> str:
        return "127.0.0.1"

    def popen(self, group: int, command: list[str], log: Any) -> Any:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self._env)

    def close(self) -> None:
        self._lighthouse.shutdown()


class _Namespaces:
    """Every group in a network namespace of its own behind a `--rate` link
    (:mod:`hemiola.bench.netlab`, root), torchft's lighthouse in one more
    (namespace 0), its log in the work folder."""

    PORT = 29510

    def __init__(self, args: argparse.Namespace, net: Any, work: Path) -> None:
        import shutil

        self._net = net
        script = Path(sys.executable).with_name("torchft_lighthouse")
        found = str(script) if script.exists() else shutil.which("torchft_lighthouse")
        if found is None:
            raise SystemExit("torchft's `torchft_lighthouse` entry point is not installed")
        timeout_ms = str(int(args.timeout * 1000))
        log_path = work / "lighthouse.log"
        with open(log_path, "w") as log:
            self._proc = net.popen(0, [sys.executable, found, "--bind",
                                       f"{net.addrs[0]}:{self.PORT}", "--min_replicas", "1",
                                       "--join_timeout_ms", timeout_ms, "--quorum_tick_ms",
                                       "100", "--heartbeat_timeout_ms", timeout_ms],
                                   stdout=log, stderr=subprocess.STDOUT)
        self.address = f"http://{net.addrs[0]}:{self.PORT}"
        deadline = time.monotonic() + 60
        while "listening on" not in log_path.read_text():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lighthouse did not start: see {log_path}")
            time.sleep(0.1)

    def host(self, group: int) -> str:
        return str(self._net.addrs[group + 1])

    def popen(self, group: int, command: list[str], log: Any) -> Any:
        return self._net.popen(group + 1, command,
                               env={"GLOO_SOCKET_IFNAME": self._net.ifaces[group + 1]},
                               stdout=log, stderr=subprocess.STDOUT)

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _run(args: argparse.Namespace, place: Any, work: Path) -> int:
    """The controller, with the lighthouse and the groups where `place` puts them."""
    rng = random.Random(args.seed)
    # One kill at a time, each after the last victim is back in the run:
    # which group, after how many of its steps from then, and whether while
    # a sync is in progress.
    plans = [{"after": rng.randint(5, 40), "in_flight": k < args.in_flight}
             for k in range(args.kills)]
    rng.shuffle(plans)
    common = {"lighthouse": place.address, "task": args.task, "steps": args.steps,
              "sync_every": args.sync_every, "fragments": args.fragments,
              "overlap": args.overlap, "outer_lr": args.outer_lr,
              "outer_momentum": args.outer_momentum, "timeout": args.timeout,
              "seed": args.seed, "go": str(work / "go")}
    procs: dict[int, tuple[Any, Path]] = {}
    current: dict[int, Path] = {}  # each group's latest incarnation's file
    outputs: list[Path] = []
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    def start(group: int, restarted: bool) -> None:
        out = work / f"g{group}-{len(outputs)}.json"
        outputs.append(out)
        current[group] = out
        config = {**common, "name": f"g{group}", "index": group, "out": str(out),
                  "host": place.host(group), "namespaced": args.rate != "none",
                  "arm": str(work / f"arm-g{group}.json"), "restarted": restarted,
                  "ready": str(out.with_suffix(".ready"))}
        with open(work / f"{out.stem}.log", "w") as log_file:
            procs[group] = (place.popen(
                group, [sys.executable, "-m", "hemiola.bench.elastic_torchft", "--worker",
                        json.dumps(config)], log_file), out)

    def everyone_in() -> bool:
        # Every group's latest incarnation has committed a sync whose quorum
        # had every group in it.
        for out in current.values():
            state = _read(out)
            if state is None or not any(s["committed"] and len(s["participants"]) == args.groups
                                        for s in state["syncs"]):
                return False
        return True

    def lead() -> int:
        return max((s["inner_steps"] for out in current.values() if (s := _read(out))),
                   default=0)

    kills = kills_in_flight = 0
    stranded: list[str] = []
    armed: int | None = None
    armed_plan: dict[str, Any] = {}
    first_finish: float | None = None
    try:
        for group in range(args.groups):
            start(group, restarted=False)
        # The first quorum with every group in it: each waits for "go" with its
        # Manager up (heartbeating to the lighthouse).
        while not all(p.with_suffix(".ready").exists() for p in current.values()):
            for group, (proc, out) in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"group g{group} failed at start: see "
                                       f"{out.with_suffix('.log')}")
            time.sleep(0.1)
        Path(common["go"]).write_text("go")
        while procs:
            time.sleep(0.1)
            if armed is None and plans and everyone_in():
                plan = plans[-1]
                # Leave the victim's restart time to join before the run ends
                if lead() + plan["after"] + 3 * args.sync_every > args.steps:
                    log(f"{len(plans)} kill(s) left out: too few inner steps left")
                    plans.clear()
                else:
                    armed_plan = plans.pop()
                    armed = rng.randrange(args.groups)
                    (work / f"arm-g{armed}.json").write_text(json.dumps(armed_plan))
            for group, (proc, out) in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[group]
                if code == -signal.SIGKILL and group == armed:
                    kills += 1
                    kills_in_flight += bool(armed_plan["in_flight"])
                    armed = None
                    log(f"kill {kills}: group g{group} killed itself "
                        f"({'in flight' if armed_plan['in_flight'] else 'between syncs'}); "
                        "starting it again")
                    start(group, restarted=True)
                elif code == 0:
                    first_finish = first_finish or time.monotonic()
                elif first_finish is not None:
                    stranded.append(f"g{group}")  # e.g. its quorum timed out
                    log(f"group g{group} ended ({code}) after the run ended")
                else:
                    raise RuntimeError(f"group g{group} failed ({code}): see "
                                       f"{out.with_suffix('.log')}")
            # A group that had not joined when the others finished has nobody
            # to heal from: it is stopped.
            if first_finish is not None and time.monotonic() - first_finish > 3 * args.timeout + 30:
                for group, (proc, _) in list(procs.items()):
                    proc.kill()
                    proc.wait()
                    del procs[group]
                    stranded.append(f"g{group}")
                    log(f"group g{group} stopped: not done {3 * args.timeout + 30:.0f} s "
                        "after the first group finished")
    finally:
        for proc, _ in procs.values():
            proc.kill()
            proc.wait()
        place.close()
    results = [r for p in outputs if (r := _read(p)) is not None]
    rows = summarise(results, kills, kills_in_flight, stranded, args)
    write_lines(args.out / f"{args.name}.jsonl", rows)
    print(f"logs and results: {work}", file=sys.stderr)
    return 0


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(results: list[dict[str, Any]], kills: int, kills_in_flight: int,
              stranded: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The suite's row (printed too) from every incarnation's results."""
    failures = [r for res in results for r in res["recoveries"] if r["what"] != "admit"]
    admits = [r for res in results for r in res["recoveries"] if r["what"] == "admit"]
    lost = [r["steps_lost"] for r in failures if r["steps_lost"] is not None]
    stalls = [r["stall_s"] for r in failures]
    finished = [res for res in results if res["finished"]]
    # Per finished group, as hemiola's row counts it: the inner steps it took
    # beyond the run's length less the step it joined at.
    redone = [res["executed"] - (res["inner_steps"] - (res["joined_at_step"] or 0))
              for res in finished]
    contribute = [res["first_commit_after"] for res in results
                  if res["restarted"] and res["first_commit_after"] is not None]
    own = [res["own_commit_after"] for res in results
           if res["restarted"] and res["own_commit_after"] is not None]
    discarded_by_heal = [res["discarded_by_heal"] for res in results
                         if res["discarded_by_heal"] is not None]
    finals = {res["shared_sha256"] for res in finished}
    quorums = {s["quorum_id"] for res in results for s in res["syncs"]}
    row = {
        "suite": "elastic_torchft", "library": "torchft", "task": args.task,
        "groups": args.groups, "kills": kills, "kills_in_flight": kills_in_flight,
        "steps": args.steps, "sync_every": args.sync_every, "fragments": args.fragments,
        "overlap": args.overlap, "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum, "timeout_s": args.timeout,
        "rate": args.rate,
        "epochs": len(quorums),
        "survivor_failures": len(failures),
        # a sync whose commit failed: DiLoCo restored its backup
        "discarded": sum(r["what"] == "failure" for r in failures),
        # a member lost between syncs: the next quorum went on without it
        "shrunk": sum(r["what"] == "shrink" for r in failures),
        "steps_lost_max": max(lost) if lost else None,
        "steps_lost_mean": _mean(lost),
        "stall_s_max": max(stalls) if stalls else None,
        "stall_s_mean": _mean(stalls),
        "admit_stall_s_max": max((r["stall_s"] for r in admits), default=None),
        "steps_to_contribute_max": max(contribute) if contribute else None,
        "steps_to_contribute_mean": _mean(contribute),
        "steps_to_own_contribution_max": max(own) if own else None,
        "discarded_by_heal_max": max(discarded_by_heal) if discarded_by_heal else None,
        "redone_steps_max": max(redone) if redone else None,
        "fragment_period": args.sync_every // args.fragments,
        "finished_replicas": len(finished),
        "stranded": stranded,
        "final_shared_bitwise_equal": len(finals) == 1,
    }
    print(json.dumps(row, indent=1))
    return [row]


class _QuorumRecorder:
    """Stands in for a Manager's ``ManagerClient``, keeping the last quorum it
    returned (torchft's Manager keeps its id, not its members)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def worker(config: dict[str, Any]) -> None:
    """One replica group: trains to the run's last inner step under torchft's
    DiLoCo, or kills itself as planned."""
    import copy
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    from hemiola.bench.streaming_rank import torchft_fragments
    from hemiola.bench.tasks import TASKS

    torch.set_num_threads(1)
    task = TASKS[config["task"]]()
    torch.manual_seed(config["seed"])
    model = task.model()
    optimizer = task.optimizer(model)
    period = config["sync_every"] // config["fragments"]
    timeout = timedelta(seconds=config["timeout"])
    state: dict[str, Any] = {"healed": False}

    def state_dict() -> dict[str, Any]:
        # Copies: on CPU torchft's HTTP transport serves the tensors it is given.
        return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "inner": copy.deepcopy(optimizer.state_dict())}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["inner"])
        state["healed"] = True

    host = config["host"]
    transport = None
    if config["namespaced"]:
        from torchft.checkpointing.http_transport import HTTPTransport

        class Transport(HTTPTransport[dict[str, Any]]):
            """torchft's checkpoint server, advertised at this namespace's
            address (not the machine's hostname's, which is not reachable)."""

            def address(self) -> str:
                port = self._server.socket.getsockname()[1]
                return f"http://{host}:{port}/checkpoint/"

        transport = Transport(timeout=timeout, num_chunks=0)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=1, use_async_quorum=False,
        replica_id=config["name"], store_addr=host, store_port=store.port,
        lighthouse_addr=config["lighthouse"], rank=0, world_size=1, port=0,
        hostname=host, init_sync=False, timeout=timeout, checkpoint_transport=transport,
        quorum_timeout=timedelta(seconds=max(60.0, 6 * config["timeout"])),
        connect_timeout=timeout)
    recorder = _QuorumRecorder(manager._client)
    manager._client = recorder
    momentum = config["outer_momentum"]
    fragments = (torchft_fragments(model, config["fragments"]) if config["fragments"] > 1
                 else [model])
    # one outer optimizer per fragment (one over the whole model would step
    # the fragments not being synced with the inner gradient in their .grad)
    outer = [torch.optim.SGD(piece.parameters(), lr=config["outer_lr"], momentum=momentum,
                             nesterov=momentum > 0) for piece in fragments]
    diloco = DiLoCo(manager, fragments, optimizer, outer, sync_every=config["sync_every"],
                    pin_memory=False, fragment_sync_delay=config["overlap"])
    frags = diloco._fragments

    def backup_sha(f: int) -> str:
        digest = hashlib.sha256()
        for t in frags[f].original_parameters.values():
            digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def live_sha(f: int) -> str:
        digest = hashlib.sha256()
        for _, p in frags[f]._model_fragment.named_parameters():
            digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def inner_steps() -> int:
        """The run's inner step: committed fragment syncs times the fragment
        period, plus DiLoCo's steps since its last sync."""
        return manager.current_step() * period + diloco._local_step

    executed = 0
    # per fragment, the backups it had: SHA-256 -> our executed steps then
    backups: list[dict[str, int]] = [{backup_sha(f): 0} for f in range(len(frags))]
    syncs: list[dict[str, Any]] = []
    recoveries: list[dict[str, Any]] = []
    episode: dict[str, Any] | None = None  # a failure being lived through
    sync: dict[str, Any] = {}
    prev_members: set[str] | None = None
    joined_at_step: int | None = None
    discarded_by_heal: int | None = None
    first_commit_after: int | None = None
    own_commit_after: int | None = None  # its first commit with its own steps in it
    die: dict[str, Any] | None = None
    armed_at = 0

    def snapshot(finished: bool) -> None:
        digest = hashlib.sha256()
        for f in range(len(frags)):
            digest.update(bytes.fromhex(backup_sha(f)))
        result = {"name": config["name"], "restarted": config["restarted"],
                  "executed": executed, "finished": finished, "inner_steps": inner_steps(),
                  "joined_at_step": joined_at_step, "discarded_by_heal": discarded_by_heal,
                  "first_commit_after": first_commit_after,
                  "own_commit_after": own_commit_after,
                  "shared_sha256": digest.hexdigest(), "syncs": syncs,
                  "recoveries": recoveries}
        out = Path(config["out"])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)

    def maybe_die(in_flight: bool) -> None:
        if (die is not None and executed - armed_at >= die["after"]
                and die["in_flight"] == in_flight):
            snapshot(finished=False)
            os.kill(os.getpid(), signal.SIGKILL)

    start_quorum = manager.start_quorum

    def timed_start_quorum(*args: Any, **kwargs: Any) -> None:
        nonlocal joined_at_step, discarded_by_heal
        sync.clear()
        sync["start"] = time.monotonic()
        sync["at"] = executed
        start_quorum(*args, **kwargs)
        sync["blocked_s"] = time.monotonic() - sync["start"]
        if state["healed"] and joined_at_step is None:
            joined_at_step = inner_steps()
            discarded_by_heal = executed
            # the healed backups: a failure before the next commit restores them
            backups[:] = [{backup_sha(f): executed} for f in range(len(frags))]
            sync["healed"] = True

    manager.start_quorum = timed_start_quorum  # type: ignore[method-assign]

    for f, frag in enumerate(frags):
        prepare, perform = frag.prepare_sync, frag.perform_sync

        def timed_prepare(prepare: Any = prepare) -> None:
            t = time.monotonic()
            prepare()
            sync["blocked_s"] += time.monotonic() - t
            if config["overlap"] == 0:  # in flight: posted, not waited for
                maybe_die(in_flight=True)

        def timed_perform(f: int = f, perform: Any = perform) -> bool:
            t = time.monotonic()
            committed = perform()
            sync["blocked_s"] += time.monotonic() - t
            record_sync(f, committed)
            return committed

        frag.prepare_sync = timed_prepare  # type: ignore[method-assign]
        frag.perform_sync = timed_perform  # type: ignore[method-assign]

    def record_sync(f: int, committed: bool) -> None:
        nonlocal episode, prev_members, first_commit_after, own_commit_after
        quorum = recorder.last
        members = set(quorum.replica_ids) if quorum is not None else set()
        short = sorted(m.split(":")[0] for m in members)
        lost_member = prev_members is not None and bool(prev_members - members)
        new_member = prev_members is not None and bool(members - prev_members)
        steps_lost = None
        if not committed:
            # DiLoCo put the fragment back to its backup: which one, and how
            # many of our inner steps ago was it taken?
            at = backups[f].get(live_sha(f))
            steps_lost = executed - at if at is not None else None
        else:
            backups[f] = {backup_sha(f): executed}
            if first_commit_after is None:
                first_commit_after = executed
            # a healing sync sends the pseudo-gradient healed from: our own
            # steps count from the next commit on
            if own_commit_after is None and not sync.get("healed", False):
                own_commit_after = executed
        entry = {"at": sync["at"], "fragment": f, "quorum_id": manager._quorum_id,
                 "participants": short, "committed": committed,
                 "blocked_s": sync["blocked_s"], "healed": sync.get("healed", False),
                 "steps_lost": steps_lost, "inner_steps": inner_steps()}
        syncs.append(entry)
        if episode is None and (not committed or lost_member):
            episode = {"what": "failure" if not committed else "shrink", "at": sync["at"],
                       "quorum_id": manager._quorum_id, "steps_lost": steps_lost or 0,
                       "steps_lost_measured": committed or steps_lost is not None,
                       "stall_s": 0.0, "syncs": 0}
        if episode is not None:
            episode["stall_s"] += sync["blocked_s"]
            episode["syncs"] += 1
            if not committed and episode["syncs"] > 1:
                episode["steps_lost"] += steps_lost or 0
            if committed:
                recoveries.append(episode)
                episode = None
        elif new_member and committed:
            recoveries.append({"what": "admit", "at": sync["at"],
                               "quorum_id": manager._quorum_id, "stall_s": sync["blocked_s"],
                               "steps_lost": 0})
        prev_members = members
        snapshot(finished=False)

    diloco.__enter__()
    Path(config["ready"]).write_text("ready")
    if not config["restarted"]:  # the first quorum: every group is up
        while not os.path.exists(config["go"]):
            time.sleep(0.05)
    x_all, y_all = task.epoch_samples(config["seed"], 0)
    g = torch.Generator().manual_seed(config["seed"] * 1000 + config["index"])
    mine = torch.randperm(len(x_all), generator=g)
    while (step := inner_steps() + 1) <= config["steps"]:
        at = (step * task.batch_size) % max(1, len(mine) - task.batch_size)
        idx = mine[at:at + task.batch_size]
        optimizer.zero_grad()
        task.loss(model, x_all[idx], y_all[idx]).backward()
        executed += 1  # (counted before the step: a sync in it may kill us)
        optimizer.step()
        if die is None and os.path.exists(config["arm"]):
            die = json.loads(Path(config["arm"]).read_text())
            os.remove(config["arm"])
            armed_at = executed
        pending = any(frag._allreduce_work for frag in frags)
        if config["overlap"] > 0 or not die or not die["in_flight"]:
            maybe_die(in_flight=pending)
    snapshot(finished=True)
    diloco.__exit__(None, None, None)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
