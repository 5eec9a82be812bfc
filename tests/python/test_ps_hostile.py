"""The parameter server under hostile input: strangers, garbage, replays,
wrong tokens, silence, non-finite gradients and broken snapshots. Real
processes and real sockets; the attacker speaks the wire format from Python."""

from __future__ import annotations

from pathlib import Path

import ps_hostile
import pytest
import torch

from hemiola._native import C
from hemiola.launch import run_local

from models import loss_of, make_batch, make_model, make_optimizer

TOKEN = "job-7f3a-secret"
STEPS = 30


def _local_sgd(steps: int, worker: int, workers: int) -> dict[str, torch.Tensor]:
    """What worker `worker` computes alone with torch's SGD on its own batches."""
    torch.manual_seed(0)
    m = make_model("mlp")
    opt = make_optimizer("sgd", m.parameters())
    for step in range(steps):
        x, y = make_batch("mlp", step, worker, workers)
        opt.zero_grad()
        loss_of("mlp", m(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_fuzzed_server_keeps_serving_and_applies_nothing_hostile() -> None:
    # The fuzzer holds worker 1's place, so the real worker pushes alone and
    # fresh: with torch's momentum on every push ("none") that is torch's own
    # step ("rescaled" would spread a round over the job's 2 workers).
    options = {"consistency": "asp", "num_servers": 1, "timeout_s": 6.0,
               "momentum_rule": "none"}
    outcome = run_local(ps_hostile.fuzz_job, 3, options, STEPS, TOKEN, 1234,
                        env={"HEMIOLA_JOB_TOKEN": TOKEN}, timeout_s=120)
    server, worker, fuzz = outcome[0], outcome[1], outcome[2]

    # It listens on the chosen address (the one routing to MASTER_ADDR), not all interfaces.
    assert fuzz["address"] == "127.0.0.1" and fuzz["listening_on"] == "127.0.0.1", fuzz

    # Every stranger was refused at the handshake, most with a reason.
    answers = fuzz["answers"]
    for i in range(8):
        assert answers[f"random {i}"] == "closed" or "refused" in answers[f"random {i}"]
    assert answers["truncated"] == "closed"
    assert "out of range" in answers["terabyte"]
    assert "oversized hello" in answers["oversized"]
    assert "checksum" in answers["garbled"]
    assert "wrong job token" in answers["wrong token"]
    assert "no job token" in answers["no token"]
    assert "not a hello" in answers["push first"]
    assert "worker index 7" in answers["worker 7"]
    assert all(TOKEN not in text for text in answers.values())
    assert server["refused"] >= 16  # the 15 above and the silent one

    # The admitted fuzzer's hostile messages were each rejected, with the reason.
    errors = [r for r in fuzz["replies"] if r.startswith("error")]
    for fragment in ("out of order: sequence number 1", "out of order: sequence number 0",
                     "expected 256", "no key 99", "computed on version 1000000",
                     "non-finite gradient for parameter 'net.0.bias'",
                     "claims to come from worker 7", "holds no key -1"):
        assert any(fragment in e for e in errors), (fragment, errors)
    assert all("not applied" in e for e in errors), errors

    # A connection that never spoke was dropped after timeout_s (6 s), telling it why.
    assert 5.5 <= fuzz["silent_dropped_after_s"] < 12, fuzz["silent_dropped_after_s"]
    assert "said nothing for 6 s" in fuzz["silent_told"]

    # Garbage inside the admitted connection dropped that connection only.
    assert server["dead_workers"] == [1]
    assert any("protocol violation" in r for r in server["rejections"]), server["rejections"]

    # The real worker trained through it all, and its result is exactly its own
    # SGD: nothing the fuzzer sent was applied.
    assert worker["losses"] and len(worker["losses"]) == STEPS
    assert server["pushes_applied"] == STEPS * 6  # one push per tensor per step, no more
    assert server["rejected"] == len(errors)
    expected = _local_sgd(STEPS, 0, 2)
    for name, value in expected.items():
        torch.testing.assert_close(worker["params"][name], value, rtol=1e-5, atol=1e-6)


def test_a_worker_without_the_job_token_is_refused() -> None:
    options = {"consistency": "asp", "num_servers": 1, "timeout_s": 10.0}
    for tokens, fragment in (({0: TOKEN, 1: TOKEN, 2: "other"}, "HemiolaError: worker 1: "
                              "parameter server 0 refused the connection: wrong job token"),
                             # it would read rank 0's token file: rank 0 has none
                             ({0: TOKEN, 1: TOKEN, 2: None}, "RuntimeError: hemiola.ps: rank 0 "
                              "was given HEMIOLA_JOB_TOKEN, rank 2 was not"),
                             # without one, the job makes its own: not this one
                             ({0: None, 1: None, 2: TOKEN}, "HemiolaError: worker 1: "
                              "parameter server 0 refused the connection: wrong job token")):
        outcome = run_local(ps_hostile.token_job, 3, options, tokens, expect_errors=True,
                            timeout_s=60)
        status, text = outcome[2]  # worker 1: refused, clearly, before anything else
        assert status == "error" and fragment in text, text
        assert TOKEN not in text
        # The server never started serving: it names the worker that did not join.
        status, text = outcome[0]
        assert status == "error" and "worker(s) 1 did not connect" in text, text
        assert "HemiolaTimeoutError" in text


def test_local_jobs_get_a_random_token_unless_one_is_given(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """run_local (and with it hemiola demo --ps) never starts an open server;
    a job across machines without a token is refused."""
    from hemiola.ps.job_token import job_token, one_machine
    from hemiola.ps.roles import Role

    monkeypatch.delenv("HEMIOLA_JOB_TOKEN", raising=False)
    first, second = (run_local(ps_hostile.token_seen, 2) for _ in range(2))
    assert first[0] == first[1] and len(first[0]) == 32, first  # one per job, 128 bits
    assert second[0] != first[0]  # fresh per job
    assert run_local(ps_hostile.token_seen, 2, env={"HEMIOLA_JOB_TOKEN": TOKEN}) == {
        0: TOKEN, 1: TOKEN}
    # Without a token, a job on one machine makes its own (stranger_job); one
    # across machines cannot share it, and is refused, saying what to do.
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for env, one in (({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"},
                      True),
                     ({"WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1"}, True),
                     ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1"},
                      False),
                     ({"WORLD_SIZE": "8", "MASTER_ADDR": "node-0"}, False)):
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            assert one_machine() == one, env
            if not one:
                with pytest.raises(RuntimeError, match="set HEMIOLA_JOB_TOKEN to the same"), \
                        job_token(Role(1, 8, 1), C.MemoryStore(), 1.0):
                    pass


def test_a_stranger_cannot_join_a_torchrun_job_without_a_token(tmp_path: Path) -> None:
    """torchrun sets no HEMIOLA_JOB_TOKEN. A stranger on the machine used to
    take worker 1's place there and register a bogus model (the real worker
    then failed: "the model of worker 0 (rank 1) differs"). Now rank 0 makes
    a token in a file only the job's user reads, publishes its path: the
    stranger, run as another user, finds the path and cannot read it."""
    options = {"consistency": "bsp", "num_servers": 1, "timeout_s": 20.0}
    outcome = run_local(ps_hostile.stranger_job, 4, options, timeout_s=90)
    server, worker0, worker1, stranger = (outcome[r] for r in range(4))
    assert "no job token presented" in stranger["answer"], stranger
    path = stranger["token_path"]  # the store tells anyone where the token is ...
    if stranger["other_user"]:  # ... but another user cannot read it
        assert "Permission denied" in stranger["token_file_error"], stranger
    assert not Path(path).exists()  # removed when the server stopped
    assert server["rejected"] == 0 and server["pushes_applied"] == 3 * 6 * 2, server
    torch.testing.assert_close(worker0["params"], worker1["params"], rtol=0, atol=0)


def test_a_worker_that_never_reads_its_replies_is_dropped() -> None:
    """A worker holding the token asks for 400 copies of a 1 MiB key and reads
    none: the server's send queue to it used to keep them all (400 MiB). Now
    the server drops it past its bound (16 MiB plus four copies of its
    shard), saying why and naming it; its memory stays bounded and the real
    worker trains on."""
    options = {"consistency": "asp", "num_servers": 1, "timeout_s": 20.0}
    outcome = run_local(ps_hostile.unread_pulls_job, 3, options, 400,
                        env={"HEMIOLA_JOB_TOKEN": TOKEN}, timeout_s=120)
    server, worker, greedy = outcome[0], outcome[1], outcome[2]
    assert 400 * greedy["reply_bytes"] == 400 * 2**20, greedy
    assert greedy["dropped"] and greedy["dropped_after_s"] < 10, greedy
    assert server["peak_rss_growth_mb"] < 100, server["peak_rss_growth_mb"]
    assert server["dead_workers"] == [1], server
    assert any("worker 1 (rank 2) disconnected: more than" in r
               and "it does not read what it asks for" in r for r in server["rejections"]), server
    assert len(worker["losses"]) == 10


def test_workers_must_agree_on_valid_optimizer_settings() -> None:
    """Two jobs in one spawned group. Workers at learning rates 0.05 and 0.5:
    bsp used to average their gradients and step with whichever pushed last,
    without a word. Worker 1 setting lr = NaN mid-run: the bsp round used to
    lock, the other worker waiting timeout_s (20 s) for "a worker" named by
    nobody."""
    outcome = run_local(ps_hostile.settings_jobs, 3, timeout_s=90)
    assert "differ" in outcome[0]["mismatch"]["error"], outcome[0]
    for rank in (1, 2):
        text = outcome[rank]["mismatch"]["error"]  # whichever registered first is the reference
        assert text.startswith("ValueError: the optimizer settings of parameter 'net.0.weight' "
                               "differ: worker "), text
        assert "lr 0.5" in text and "lr 0.05" in text and "worker 1 (rank 2)" in text, text
    bad, honest = outcome[2]["nan"], outcome[1]["nan"]
    assert bad["error"].startswith("ValueError: parameter 'net.0.weight' would step with a "
                                   "non-finite lr (nan)"), bad
    assert "worker 1 (rank 2)" in honest["error"], honest
    assert honest["after_s"] < 10, honest  # at once, not after timeout_s
    assert "worker 1 (rank 2)" in outcome[0]["nan"]["error"], outcome[0]


def test_right_token_trains() -> None:
    options = {"consistency": "bsp", "num_servers": 1, "timeout_s": 20.0}
    outcome = run_local(ps_hostile.token_job, 3, options, {0: TOKEN, 1: TOKEN, 2: TOKEN},
                        timeout_s=90)
    assert outcome[0]["rejected"] == 0 and outcome[0]["pushes_applied"] == 3 * 6 * 2
    torch.testing.assert_close(outcome[1]["params"], outcome[2]["params"], rtol=0, atol=0)


@pytest.mark.parametrize("consistency", ["bsp", "asp"])
def test_non_finite_gradient_names_the_parameter(consistency: str) -> None:
    outcome = run_local(ps_hostile.nan_job, 2, consistency, expect_errors=True, timeout_s=60)
    status, result = outcome[1]
    assert status == "ok", result
    assert result["error"] is not None and result["step"] >= 2, result
    assert "non-finite gradient for parameter 'net." in result["error"], result["error"]
    assert "(element " in result["error"] and "is nan" in result["error"]
    status, server = outcome[0]
    if consistency == "bsp":  # the round cannot complete: the job stops, saying why
        assert status == "error" and "non-finite gradient" in server, server
    else:
        assert status == "ok" and server["rejected"] >= 1, server


def _restore(path: Path, store_dir: Path) -> None:
    C.ps.Server(server_index=0, num_servers=1, num_workers=1, consistency="bsp",
                timeout_s=2.0, store=C.FileStore(str(store_dir)), snapshot_path=str(path),
                restore=True)


def test_corrupted_or_truncated_snapshot_is_refused(tmp_path: Path) -> None:
    # A real snapshot, from a real job.
    outcome = run_local(ps_hostile.snapshot_job, 2, str(tmp_path), timeout_s=90)
    assert outcome[0]["snapshots"] >= 1
    good = (tmp_path / "server-0.snap").read_bytes()
    with pytest.raises(C.HemiolaTimeoutError):  # a good snapshot loads; then no worker comes
        _restore(tmp_path / "server-0.snap", tmp_path / "store0")
    bad = tmp_path / "bad.snap"
    for at in (0, 9, len(good) // 2, len(good) - 1):
        flipped = bytearray(good)
        flipped[at] ^= 0x40
        bad.write_bytes(bytes(flipped))
        with pytest.raises(ValueError, match="refusing to load it|not a hemiola") as e:
            _restore(bad, tmp_path / f"store-flip-{at}")
        assert at == 0 or "corrupted" in str(e.value) or "format" in str(e.value), str(e.value)
    for keep in (0, 10, 30, len(good) // 2, len(good) - 8, len(good) - 1):
        bad.write_bytes(good[:keep])
        with pytest.raises(ValueError, match="truncated|not a hemiola"):
            _restore(bad, tmp_path / f"store-cut-{keep}")


def test_silent_connections_do_not_lock_the_workers_out() -> None:
    """80 connections that never say hello, opened before the workers join
    (more than the 64 the server lets wait): each newcomer evicts the one
    waiting longest, so the workers are admitted and train; before, the
    server refused them while the silent ones held every slot for timeout_s."""
    options = {"consistency": "bsp", "num_servers": 1, "timeout_s": 30.0}
    outcome = run_local(ps_hostile.flood_job, 3, options, 80, timeout_s=120)
    assert outcome[0]["pushes_applied"] == 2 * 4 * 6, outcome[0]  # workers x steps x tensors
    assert outcome[0]["refused"] >= 80 - 64, outcome[0]  # evicted, or dropped after the deadline
    torch.testing.assert_close(outcome[1]["params"], outcome[2]["params"], rtol=0, atol=0)
