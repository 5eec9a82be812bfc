"""Parameter server, end to end: real server and worker processes over Gloo."""

from __future__ import annotations

from typing import Any

import ps_workers
import pytest
import torch

from hemiola.launch import run_local


def _workers(results: dict[int, object]) -> list[dict]:
    out = [v for v in results.values() if isinstance(v, dict) and "worker" in v]
    return sorted(out, key=lambda v: v["worker"])


@pytest.mark.parametrize("servers,workers,model,opt", [
    (1, 2, "mlp", "sgd"),
    (2, 3, "cnn", "sgd"),
    (2, 2, "transformer", "adamw"),
])
def test_bsp_equals_wfbp_allreduce(servers: int, workers: int, model: str, opt: str) -> None:
    steps = 4
    reference = run_local(ps_workers.wfbp_train, workers, model, opt, steps)[0]
    # Small partitions, so tensors are split across servers too.
    options = {"consistency": "bsp", "num_servers": servers, "partition_mb": 0.004,
               "timeout_s": 60}
    results = run_local(ps_workers.train, servers + workers, options, model, opt, steps)
    ws = _workers(results)
    assert len(ws) == workers
    for w in ws:
        for name, ref in reference.items():
            torch.testing.assert_close(w["params"][name], ref, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name, i=w["worker"]: f"worker {i} {n}: {m}")
        assert all(r["staleness"] == 0 for r in w["records"])
        assert "closed" in w["step_after_close"]
    served = [v for v in results.values() if isinstance(v, dict) and "server" in v]
    assert sum(s["pushes_applied"] for s in served) > 0
    assert all(s["rejected"] == 0 for s in served)


def test_pull_lands_where_the_parameter_is_first_read() -> None:
    # PeekMLP reads fc1.weight in its own forward before calling fc1. Worker
    # 1 lags, so worker 0's bsp pulls are still in flight when its next
    # forward starts: the pull must be taken before that first read (where
    # the forward gate learnt it), not at fc1, or the gradient is silently
    # taken at stale values.
    steps = 4
    reference = run_local(ps_workers.wfbp_train, 2, "peek", "sgd", steps)[0]
    options = {"consistency": "bsp", "num_servers": 1, "timeout_s": 60}
    results = run_local(ps_workers.train, 3, options, "peek", "sgd", steps, {1: 0.1})
    for w in _workers(results):
        for name, ref in reference.items():
            torch.testing.assert_close(w["params"][name], ref, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name, i=w["worker"]: f"worker {i} {n}: {m}")


@pytest.mark.parametrize("consistency,correction,w0_taus", [
    ("asp", True, [0, 0, 0]),
    ("eager", False, [0, 1, 1]),
    # the own push is in the corrected value: only other workers' pushes count
    ("eager", True, [0, 0, 0]),
])
def test_staleness_matches_the_push_schedule(consistency: str, correction: bool,
                                             w0_taus: list[int]) -> None:
    results = run_local(ps_workers.scheduled_staleness, 3, consistency, correction)
    w0, w1 = _workers(results)
    for key in (0, 1):  # weight and bias
        taus = [r["staleness"] for r in w0["records"] if r["key"] == key]
        assert taus == w0_taus
        [late] = [r for r in w1["records"] if r["key"] == key]
        assert (late["computed_on"], late["applied_at"], late["staleness"]) == (0, 3, 3)
        assert late["lr_factor"] == pytest.approx(0.25)  # "inverse": 1/(1+tau)
    assert w1["staleness"]["max"] == 3


def test_default_staleness_rule_is_none_where_the_momentum_rule_averages() -> None:
    from hemiola.ps import PSConfig

    assert PSConfig(consistency="bsp").rule("adam") == "none"
    for consistency in ("asp", "ssp", "eager"):
        assert PSConfig(consistency=consistency).rule("sgd") == "none"  # "rescaled"
        for optimizer in ("adam", "adamw"):
            assert PSConfig(consistency=consistency).rule(optimizer) == "inverse"
        for momentum_rule in ("compensated", "none"):
            config = PSConfig(consistency=consistency, momentum_rule=momentum_rule)
            assert config.rule("sgd") == "inverse"
    assert PSConfig(consistency="eager", staleness_rule="zhang").rule("sgd") == "zhang"


def test_staleness_rules() -> None:
    from hemiola._native import C

    assert [C.ps.staleness_factor("inverse", t) for t in (0, 1, 3)] == [1.0, 0.5, 0.25]
    assert [C.ps.staleness_factor("zhang", t) for t in (0, 1, 4)] == [1.0, 1.0, 0.25]
    assert C.ps.staleness_factor("none", 100) == 1.0
    with pytest.raises(Exception, match="choose one of"):
        C.ps.staleness_factor("sometimes", 1)


def _one_worker(consistency: str, correction: bool, opt: str, steps: int = 6,
                ahead: float | None = 1.0) -> dict:
    options = {"consistency": consistency, "num_servers": 1, "timeout_s": 60,
               "local_correction": correction, "ahead_fraction": ahead}
    [w] = _workers(run_local(ps_workers.train, 2, options, "mlp", opt, steps))
    return w


@pytest.mark.parametrize("opt", ["plain_sgd", "sgd", "nesterov"])
def test_eager_local_correction_puts_the_own_push_into_the_next_forward(opt: str) -> None:
    """One worker: an eager pull never holds the worker's own last push. With
    SGD the server's reply leaves out that push's momentum share and the
    worker adds its gradient's share, exactly the step the server takes, so
    eager trains as bsp does; without it every forward is one step behind."""
    bsp = _one_worker("bsp", True, opt)
    corrected = _one_worker("eager", True, opt)
    stale = _one_worker("eager", False, opt)
    torch.testing.assert_close(corrected["losses"], bsp["losses"], rtol=1e-5, atol=1e-6)
    for name, p in bsp["params"].items():  # synchronize() gives the servers' exact values
        torch.testing.assert_close(corrected["params"][name], p, rtol=1e-5, atol=1e-6)
    assert all(r["staleness"] == 0 for r in corrected["records"])
    assert {r["staleness"] for r in stale["records"]} == {0, 1}
    gaps = [abs(a - b) for a, b in zip(stale["losses"][2:], bsp["losses"][2:])]
    assert min(gaps) > 1e-4, gaps  # the check above can fail: the stale run differs


@pytest.mark.parametrize("ahead,front", [(0.0, set()), (0.2, {"net.0.weight"})])
def test_eager_pulls_ahead_only_the_front_fraction(ahead: float, front: set[str]) -> None:
    """ahead_fraction 0.2 of the MLP's 5829 elements: only net.0.weight (1280,
    the first tensor the forward reads) is pulled ahead of the push; the
    others after it, as asp pulls. Uncorrected, exactly the front tensors are
    stale; corrected, the mix still trains exactly as bsp does."""
    bsp = _one_worker("bsp", True, "sgd")
    mixed = _one_worker("eager", True, "sgd", ahead=ahead)
    stale = _one_worker("eager", False, "sgd", ahead=ahead)
    torch.testing.assert_close(mixed["losses"], bsp["losses"], rtol=1e-5, atol=1e-6)
    for name, p in bsp["params"].items():
        torch.testing.assert_close(mixed["params"][name], p, rtol=1e-5, atol=1e-6)
    assert {r["tensor"] for r in stale["records"] if r["staleness"] > 0} == front
    assert all(r["staleness"] == 0 for r in mixed["records"])


def _timed_plan(n: int) -> tuple[Any, Any]:
    """An AheadPlan over `n` tensors of 10 elements, and `iterate(count,
    seconds, waits)` feeding it iterations that wait `waits[i]` for tensor i."""
    from hemiola.ps.ahead import AheadPlan

    plan = AheadPlan([10] * n, None)

    def iterate(count: int, seconds: float, waits: dict[int, float]) -> None:
        for _ in range(count):
            for i, wait in waits.items():
                plan.waited(i, wait)
            plan.iteration_ended(seconds)

    return plan, iterate


def test_learned_ahead_plan_keeps_only_moves_that_shorten_the_iteration() -> None:
    from hemiola.ps import ahead

    plan, iterate = _timed_plan(3)
    order = [2, 0, 1]
    trial = ahead.TRIAL_ITERATIONS
    iterate(ahead.WARMUP_ITERATIONS, 10.0, {0: 9.0})  # not learnt from
    assert plan.choose(order) == []  # every pull starts after the push
    # 6% of a 10 s iteration stalls tensor 2 at once, 0.5% never stalls tensor 0;
    # the move waits until the plan as it is has been timed with the stall.
    iterate(trial - 1, 10.0, {2: 0.6, 0: 0.05})
    assert plan.choose(order) == []
    iterate(1, 10.0, {2: 0.6, 0: 0.05})
    assert plan.choose(order) == [2]  # on trial
    # One iteration untimed (its forward took the pulls of the plan before),
    # then the trial's: 20% shorter, kept.
    iterate(trial, 8.0, {0: 0.05})
    assert plan.choose(order) == [2]
    iterate(1, 8.0, {0: 0.05})
    assert plan.choose(order) == [2]
    # 1.5% of every iteration stalls tensor 1 from the fifth; it is moved once
    # ten iterations with that stall are timed, and moved back when the
    # iterations stay as long.
    iterate(4 + trial - 1, 8.0, {1: 0.12})
    assert plan.choose(order) == [2]
    iterate(1, 8.0, {1: 0.12})
    assert plan.choose(order) == [2, 1]
    iterate(1 + trial, 7.9, {})
    assert plan.choose(order) == [2]
    iterate(5 * trial, 8.0, {1: 0.8})  # not tried again
    assert plan.choose(order) == [2]


def test_learned_ahead_plan_times_the_plan_with_the_stall_it_would_remove() -> None:
    """A wait that appears late is weighed against iterations that had it,
    not against the quiet ones before it."""
    from hemiola.ps import ahead

    plan, iterate = _timed_plan(2)
    trial = ahead.TRIAL_ITERATIONS
    iterate(ahead.WARMUP_ITERATIONS + 3 * trial, 8.0, {})  # quiet: nothing stalls
    iterate(trial, 12.0, {0: 4.0})  # a 4 s wait appears
    assert plan.choose([0, 1]) == [0]  # on trial
    iterate(1 + trial, 8.5, {})  # the wait gone: 29% shorter than with it
    assert plan.choose([0, 1]) == [0]
    iterate(3 * trial, 8.5, {})
    assert plan.choose([0, 1]) == [0]


def test_fixed_ahead_plan_takes_the_front_share_of_the_bytes() -> None:
    from hemiola.ps.ahead import AheadPlan

    plan = AheadPlan([100, 10, 10, 80], 0.5)
    assert plan.choose([3, 1, 0, 2]) == [3, 1, 0]  # the front tensors covering 100 of 200
    assert plan.choose([1, 2, 3, 0]) == [1, 2, 3]
    assert AheadPlan([1, 2], 0.0).choose([0, 1]) == []
    assert AheadPlan([1, 2], 1.0).choose([1, 0]) == [1, 0]


@pytest.mark.parametrize("kept", [True, False], ids=["kept-ahead", "moved-back"])
def test_eager_switching_pulls_ahead_mid_run_trains_as_bsp_with_one_worker(kept: bool) -> None:
    """The learned plan moves every tensor ahead on trial after its warm-up,
    in the middle of the run: from then on the replies lack the own push and
    are corrected, and the pushes declare the version that includes it; then
    it keeps them there or moves them back to pulls after the push. With one
    worker and Nesterov that is still exactly bsp."""
    steps = 12
    train = (ps_workers.train_keeping_every_pull_ahead if kept
             else ps_workers.train_moving_every_pull_ahead_and_back)
    bsp = _one_worker("bsp", True, "nesterov", steps=steps)
    options = {"consistency": "eager", "num_servers": 1, "timeout_s": 60}
    [learned] = _workers(run_local(train, 2, options, "mlp", "nesterov", steps))
    every = sorted(bsp["params"])
    after_trial = every if kept else []
    assert learned["ahead_after_step"] == [[]] * 4 + [every] * 3 + [after_trial] * (steps - 7)
    torch.testing.assert_close(learned["losses"], bsp["losses"], rtol=1e-5, atol=1e-6)
    for name, p in bsp["params"].items():
        torch.testing.assert_close(learned["params"][name], p, rtol=1e-5, atol=1e-6)
    assert all(r["staleness"] == 0 for r in learned["records"])


def test_synchronize_between_forward_and_backward_keeps_the_values_read() -> None:
    results = run_local(ps_workers.synchronize_between_forward_and_backward, 3)
    w0 = _workers(results)[0]
    assert w0["changed"] == [False] * 6


def test_ahead_fraction_is_checked() -> None:
    import hemiola.ps

    with pytest.raises(ValueError, match="ahead_fraction must be within"):
        hemiola.ps.PSConfig(consistency="eager", ahead_fraction=1.5)


def test_eager_local_correction_with_adamw_tracks_bsp_closer() -> None:
    """AdamW: the worker approximates the server's second moment with its own,
    so the correction is not exact, but it must bring eager nearer to bsp."""
    bsp = _one_worker("bsp", True, "adamw", steps=8)["losses"]
    corrected = _one_worker("eager", True, "adamw", steps=8)["losses"]
    stale = _one_worker("eager", False, "adamw", steps=8)["losses"]
    distance = lambda run: sum(abs(a - b) for a, b in zip(run, bsp))  # noqa: E731
    assert distance(corrected) < 0.5 * distance(stale), (bsp, corrected, stale)


def test_async_modes_train(tmp_path: object) -> None:
    """asp, ssp and eager all reduce the loss of a real model with a straggler."""
    for consistency in ("asp", "ssp", "eager"):
        options = {"consistency": consistency, "num_servers": 1, "timeout_s": 60,
                   "staleness_bound": 1}
        results = run_local(ps_workers.train, 3, options, "mlp", "sgd", 30, {1: 0.02}, True)
        for w in _workers(results):
            first, last = w["losses"][0], w["losses"][-1]
            assert last < 0.7 * first, (consistency, w["worker"], w["losses"])
            if consistency == "ssp":
                # While one worker computes, each other one may go from s behind it to
                # s + 1 ahead: tau <= (workers - 1) * (2s + 1) = 3 for s = 1, 2 workers.
                assert w["staleness"]["max"] <= (2 - 1) * (2 * 1 + 1)


def test_ps_server_entry_point() -> None:
    results = run_local(ps_workers.through_cli, 3)
    assert results[0] is None
    assert [len(results[r]["losses"]) for r in (1, 2)] == [3, 3]
