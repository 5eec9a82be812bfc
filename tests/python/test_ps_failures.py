"""Parameter server under failure: dead workers, a dead server and its restart,
mismatched models. Real processes, real SIGKILL."""

from __future__ import annotations

from pathlib import Path

import ps_workers
import pytest
import torch

from hemiola.launch import run_local


def _by_worker(outcome: dict[int, tuple[str, object]], servers: int = 1) -> dict[int, object]:
    return {rank - servers: value for rank, (status, value) in outcome.items()
            if rank >= servers and status == "ok"}


def test_bsp_fails_naming_a_dead_worker() -> None:
    outcome = run_local(ps_workers.worker_dies, 4, "bsp", expect_errors=True, timeout_s=90)
    status, server_error = outcome[0]
    assert status == "error" and "worker 1 (rank 2)" in server_error
    assert "HemiolaTimeoutError" in server_error
    for w in (0, 2):
        status, result = outcome[w + 1]
        assert status == "ok", result
        assert result["error"] is not None and "worker 1 (rank 2)" in result["error"]
        assert result["error"].startswith("HemiolaTimeoutError")
        assert result["done"] < 12
    assert outcome[2][0] == "error"  # the killed worker itself


@pytest.mark.parametrize("consistency", ["asp", "eager"])
def test_async_goes_on_without_a_dead_worker(consistency: str) -> None:
    outcome = run_local(ps_workers.worker_dies, 4, consistency, expect_errors=True, timeout_s=90)
    status, stats = outcome[0]
    assert status == "ok", stats
    assert stats["dead_workers"] == [1]
    for w in (0, 2):
        status, result = outcome[w + 1]
        assert status == "ok" and result["error"] is None and result["done"] == 12, result


def test_server_restarts_from_its_snapshot(tmp_path: Path) -> None:
    first = run_local(ps_workers.snapshot_then_server_dies, 3, str(tmp_path), expect_errors=True,
                      timeout_s=90)
    assert first[0][0] == "error"  # the killed server
    workers = _by_worker(first)
    assert set(workers) == {0, 1}
    for w in workers.values():
        assert w["error"] is not None and "server 0 (rank 0)" in w["error"], w["error"]
    snapshot = workers[0]["snapshot"]
    assert (tmp_path / "server-0.snap").exists()

    second = run_local(ps_workers.restart_from_snapshot, 3, str(tmp_path), timeout_s=90)
    for w in (1, 2):
        result = second[w]
        for name, value in snapshot.items():
            torch.testing.assert_close(result["restored"][name], value, rtol=0, atol=0)
        # Versions went on from the snapshot's: 5 applied rounds before it.
        assert min(r["computed_on"] for r in result["records"]) == 5


def test_mismatched_models_fail_at_registration() -> None:
    outcome = run_local(ps_workers.mismatched_models, 3, expect_errors=True, timeout_s=60)
    for rank in range(3):
        status, text = outcome[rank]
        assert status == "error" and "differs" in text, (rank, text)


@pytest.mark.parametrize("consistency", ["bsp", "eager"])
def test_a_server_paused_for_less_than_the_timeout_blames_no_worker(consistency: str) -> None:
    # SIGSTOP for 3.5 s with timeout_s 4: the workers' pushes and pings queue
    # unread in the server's sockets; woken, its watchdog used to find them
    # silent (or a bsp round overdue) and name a healthy worker dead.
    outcome = run_local(ps_workers.server_paused, 4, consistency, 3.5, expect_errors=True,
                        timeout_s=120)
    status, stats = outcome[0]
    assert status == "ok", stats
    assert stats["dead_workers"] == []
    for w, result in _by_worker(outcome).items():
        assert result["error"] is None and result["done"] == 10, (w, result)
