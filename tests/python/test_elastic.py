"""Elastic streaming (hemiola.elastic): replicas as separate processes joined
through a real coordinator over TCP, killed with SIGKILL and started late."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hemiola.elastic.coordinator import Coordinator

sys.path.insert(0, str(Path(__file__).parent))
import elastic_worker  # noqa: E402

WORKER = str(Path(__file__).parent / "elastic_worker.py")


@pytest.fixture
def coordinator():
    started = []

    def start(min_replicas: int, start_replicas: int | None = None,
              timeout_s: float = 10.0) -> Coordinator:
        c = Coordinator("127.0.0.1", 0, min_replicas=min_replicas, timeout_s=timeout_s,
                        start_replicas=start_replicas)
        c.start()
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()


def wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def launch(c: Coordinator, tmp_path: Path, name: str, index: int, **options) -> tuple:
    out = tmp_path / f"{name}.json"
    args = {"coordinator": f"127.0.0.1:{c.address[1]}", "name": name, "index": index,
            "steps": 40, "sync_every": 10, "fragments": 1, "overlap": 0, "out": str(out),
            **options}
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, WORKER, json.dumps(args)], stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, out


def finish(tmp_path: Path, runs: list[tuple], timeout_s: float = 120.0) -> list[dict]:
    results = []
    for proc, out in runs:
        code = proc.wait(timeout=timeout_s)
        log = Path(str(out).replace(".json", ".log")).read_text()
        assert code == 0, f"{out.name} exited {code}:\n{log[-3000:]}"
        results.append(json.loads(out.read_text()))
    return results


def reference(steps: int, sync_every: int, alive_until: dict[int, int]) -> list[torch.Tensor]:
    """DiLoCo with the default outer step (the average) in plain torch: each
    replica `index` takes steps 1..alive_until[index]; a sync averages the
    replicas alive at it, and every one of them continues from the average."""
    models = {i: elastic_worker.make_model() for i in alive_until}
    for step in range(1, steps + 1):
        for i, model in models.items():
            if step > alive_until[i]:
                continue
            x, y = elastic_worker.batch(i, step)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= elastic_worker.LR * p.grad
        if step % sync_every == 0:
            alive = [m for i, m in models.items() if step <= alive_until[i]]
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in alive)):
                    mean = torch.stack([p for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
    survivor = next(m for i, m in models.items() if alive_until[i] == steps)
    return [p.detach().flatten() for p in survivor.parameters()]


def test_a_killed_replica_is_dropped_and_the_survivors_lose_no_step(coordinator, tmp_path):
    c = coordinator(min_replicas=2, start_replicas=3)
    runs = [launch(c, tmp_path, f"g{i}", i, die_at=15 if i == 2 else None) for i in range(3)]
    assert runs[2][0].wait(timeout=120) == -9  # SIGKILL, after its inner step 15
    survivors = finish(tmp_path, runs[:2])
    for r in survivors:
        assert r["stats"]["inner_steps"] == 40  # none lost
        assert r["stats"]["syncs"] == 4
        assert r["stats"]["replicas"] == 2
        (change,) = r["recoveries"]
        # The next sync (step 20) failed on the dead peer's closed sockets and
        # was averaged again over the two survivors.
        assert change["inner_step"] == 20 and change["what"] == "failure, averaged again"
        assert change["stall_s"] < c.timeout_s + 1
    assert survivors[0]["shared_sha256"] == survivors[1]["shared_sha256"]
    assert survivors[0]["params"] == survivors[1]["params"]
    expected = reference(40, 10, {0: 40, 1: 40, 2: 15})
    for got, want in zip(survivors[0]["params"], expected):
        torch.testing.assert_close(torch.tensor(got), want, atol=2e-6, rtol=0)
    assert [len(members) for _, members, _ in c.history] == [3, 2]


def test_a_late_group_joins_at_a_sync_with_the_shared_copy(coordinator, tmp_path):
    c = coordinator(min_replicas=2)
    # 80 steps of 0.2 s: time for the late one to start (importing torch)
    runs = [launch(c, tmp_path, f"g{i}", i, steps=80, step_s=0.2) for i in range(2)]
    wait_for(lambda: c.epoch >= 1)
    time.sleep(0.5)  # the two are training
    runs.append(launch(c, tmp_path, "g2", 2, steps=80, step_s=0.2))
    results = finish(tmp_path, runs)
    joiner = results[2]
    assert joiner["joined_at_step"] is not None and joiner["joined_at_step"] % 10 == 0
    assert joiner["joined_at_step"] < 80
    assert {r["stats"]["replicas"] for r in results} == {3}
    assert {r["stats"]["inner_steps"] for r in results} == {80}
    assert len({r["shared_sha256"] for r in results}) == 1
    # after the last (blocking) sync every replica holds the shared copy
    assert results[0]["params"] == results[1]["params"] == joiner["params"]
    for r in results[:2]:
        assert [x["what"] for x in r["recoveries"]] == ["admit"]


def test_below_min_replicas_training_pauses_until_a_restarted_group_joins(coordinator,
                                                                        tmp_path):
    # Two fragments under two later steps: the survivor finds the death when
    # the fragment sent after step 25 lands (step 27), averages it again
    # alone, and waits there for the restarted group.
    c = coordinator(min_replicas=2)
    options = {"steps": 60, "fragments": 2, "overlap": 2, "step_s": 0.05}
    survivor = launch(c, tmp_path, "g0", 0, **options)
    doomed, _ = launch(c, tmp_path, "g1", 1, die_at=23, **options)
    assert doomed.wait(timeout=120) == -9
    wait_for(lambda: c.epoch >= 2)  # the survivor's epoch of one, paused
    time.sleep(1.0)
    restarted = launch(c, tmp_path, "g1", 1, **options)  # the same name comes back
    first, second = finish(tmp_path, [survivor, restarted])
    assert [x["what"] for x in first["recoveries"]] == ["failure, averaged again", "admit"]
    assert first["recoveries"][0]["inner_step"] == 27
    assert first["recoveries"][1]["inner_step"] == 27  # it waited there: no step taken alone
    assert first["recoveries"][1]["stall_s"] >= 1.0
    assert second["joined_at_step"] == 27
    assert first["stats"]["inner_steps"] == second["stats"]["inner_steps"] == 60
    assert first["shared_sha256"] == second["shared_sha256"]
    assert [len(m) for _, m, _ in c.history] == [2, 1, 2]


def test_a_frozen_replica_is_dropped_after_the_timeout(coordinator, tmp_path):
    # SIGSTOP: its sockets stay open and its heartbeat stops, as when a
    # machine vanishes. The others wait out the timeout, then go on.
    import signal

    c = coordinator(min_replicas=2, start_replicas=3, timeout_s=3.0)
    options = {"steps": 60, "step_s": 0.05}
    runs = [launch(c, tmp_path, f"g{i}", i, **options) for i in range(3)]
    wait_for(lambda: c.epoch >= 1)
    time.sleep(2.0)
    frozen = runs[2][0]
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        survivors = finish(tmp_path, runs[:2])
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    # Woken, it finds itself counted out and says how to come back.
    assert frozen.wait(timeout=60) != 0
    assert "start it again to rejoin the run" in (tmp_path / "g2.log").read_text()
    for r in survivors:
        assert r["stats"]["inner_steps"] == 60
        (change,) = r["recoveries"]
        assert change["what"] == "failure, averaged again"
        assert 2.5 < change["stall_s"] < c.timeout_s + 1 + 3.0
    assert survivors[0]["shared_sha256"] == survivors[1]["shared_sha256"]


def test_the_coordinator_refuses_strangers_and_garbage(coordinator, monkeypatch):
    import socket

    from hemiola.elastic.client import CoordinatorClient

    c = coordinator(min_replicas=1)
    address = f"127.0.0.1:{c.address[1]}"
    # Garbage, an endless line and a bad hello: each connection is closed,
    # and the coordinator goes on serving.
    for junk in (b"\x00\xff" * 100 + b"\n", b"x" * (2 << 20), b'{"op": "beat"}\n'):
        with socket.create_connection(c.address) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(10)
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass  # closed with our bytes unread: closed all the same
    first = CoordinatorClient(address, "a")
    with pytest.raises(ValueError, match="taken by a live group"):
        CoordinatorClient(address, "a")
    epoch = first.join()
    assert (epoch.number, epoch.rank, epoch.world, epoch.fresh) == (1, 0, 1, True)
    first.close()
    late = CoordinatorClient(address, "b")
    with pytest.raises(RuntimeError, match="no live member left"):
        late.join()
    late.close()

    guarded = Coordinator("127.0.0.1", 0, token="s3cret")
    guarded.start()
    try:
        monkeypatch.delenv("HEMIOLA_JOB_TOKEN", raising=False)
        with pytest.raises(ConnectionError, match="wrong job token"):
            CoordinatorClient(f"127.0.0.1:{guarded.address[1]}", "c")
        monkeypatch.setenv("HEMIOLA_JOB_TOKEN", "s3cret")
        CoordinatorClient(f"127.0.0.1:{guarded.address[1]}", "c").close()
    finally:
        guarded.close()


def test_a_checkpoint_of_one_group_restarts_the_whole_run(coordinator, tmp_path):
    # After a blocking sync every replica holds the shared copy, so one
    # group's checkpoint is the run's: two fresh groups (and a fresh
    # coordinator) resumed from it end where the run would have.
    c = coordinator(min_replicas=2)
    whole = finish(tmp_path, [launch(c, tmp_path, f"w{i}", i) for i in range(2)])
    c2 = coordinator(min_replicas=2)
    ckpt = tmp_path / "g0.pt"
    first = finish(tmp_path, [launch(c2, tmp_path, "a0", 0, steps=20, save_at=20,
                                     save_to=str(ckpt)),
                              launch(c2, tmp_path, "a1", 1, steps=20)])
    assert first[0]["stats"]["inner_steps"] == 20
    c3 = coordinator(min_replicas=2)
    resumed = finish(tmp_path, [launch(c3, tmp_path, f"r{i}", i, load=str(ckpt))
                                for i in range(2)])
    for r in resumed:
        assert r["stats"]["inner_steps"] == 40
        assert r["params"] == whole[0]["params"]
        assert r["shared_sha256"] == whole[0]["shared_sha256"]


def launch_group(c: Coordinator, tmp_path: Path, name: str, index: int, ranks: int,
                 port: int, **options) -> tuple:
    """A replica group of `ranks` ranks: one torchrun launch of its own."""
    out = tmp_path / f"{name}.json"
    args = {"coordinator": f"127.0.0.1:{c.address[1]}", "name": name, "index": index,
            "steps": 40, "sync_every": 10, "fragments": 1, "overlap": 0, "out": str(out),
            **options}
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
         "--master_addr", "127.0.0.1", "--master_port", str(port), WORKER, json.dumps(args)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def test_replica_groups_of_two_ranks_die_and_join_as_groups(coordinator, tmp_path):
    # Three launches of two ranks each; one rank of g2 dies: its group is
    # dead (its own per-step averaging cannot go on), the two others go on
    # without losing a step, and g2 started again joins as a group.
    c = coordinator(min_replicas=2, start_replicas=3)
    options = {"steps": 200, "step_s": 0.1}
    base = 29600 + (os.getpid() % 50) * 4
    survivors = [launch_group(c, tmp_path, f"g{i}", i, 2, base + i, **options) for i in range(2)]
    doomed, _ = launch_group(c, tmp_path, "g2", 2, 2, base + 2, die_at=15, die_rank=0,
                             **options)
    assert doomed.wait(timeout=120) != 0
    wait_for(lambda: c.epoch >= 2)
    assert c.history[1][1] == ["g0", "g1"] or sorted(c.history[1][1]) == ["g0", "g1"]
    again = launch_group(c, tmp_path, "g2", 2, 2, base + 3, **options)
    for proc, out in [*survivors, again]:
        code = proc.wait(timeout=180)
        log = Path(str(out).replace(".json", ".log")).read_text()
        assert code == 0, log[-3000:]
    results = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("g?-?.json")}
    assert len(results) == 6
    assert len({r["shared_sha256"] for r in results.values()}) == 1
    for name, r in results.items():
        assert r["stats"]["inner_steps"] == 200, name
        assert r["stats"]["replica_ranks"] == 2.0
    for name in ("g0-0.json", "g0-1.json", "g1-0.json", "g1-1.json"):
        whats = [x["what"] for x in results[name]["recoveries"]]
        assert whats[0] == "failure, averaged again" and "admit" in whats, (name, whats)
    assert results["g2-0.json"]["joined_at_step"] == results["g2-1.json"]["joined_at_step"]


def test_the_coordinator_will_not_serve_the_network_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "HEMIOLA_JOB_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "hemiola", "coordinator", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "without HEMIOLA_JOB_TOKEN" in done.stderr and "--host 127.0.0.1" in done.stderr


def test_the_coordinator_keeps_an_average_every_survivor_has_and_redoes_the_rest(coordinator):
    # The decision alone, from clients that report as survivors would: a
    # sync whose average every survivor has is kept; at the latest sync, one
    # survivor without it makes all redo it; a survivor a sync behind keeps
    # its own (the other's confirmation of it completed, so all had it).
    import concurrent.futures

    from hemiola.elastic.client import CoordinatorClient

    def run(reports: dict[str, tuple[int, bool]]) -> dict[str, tuple[int, int, bool]]:
        c = coordinator(min_replicas=1, start_replicas=3)
        address = f"127.0.0.1:{c.address[1]}"
        clients = {name: CoordinatorClient(address, name) for name in ("a", "b", "dead")}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = dict(zip(clients, pool.map(lambda cl: cl.join(), clients.values())))
        assert {e.number for e in first.values()} == {1}
        clients.pop("dead").close()  # its heartbeat connection closes: dead at once
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = dict(zip(reports, pool.map(
                lambda item: clients[item[0]].reform(1, *item[1]), reports.items())))
        for client in clients.values():
            client.close()
        return {n: (e.number, e.world, e.keep) for n, e in answers.items()}

    assert run({"a": (5, True), "b": (5, True)}) == {"a": (2, 2, True), "b": (2, 2, True)}
    assert run({"a": (5, True), "b": (5, False)}) == {"a": (2, 2, False), "b": (2, 2, False)}
    assert run({"a": (5, True), "b": (6, False)}) == {"a": (2, 2, True), "b": (2, 2, False)}
