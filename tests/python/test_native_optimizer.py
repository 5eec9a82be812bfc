"""The engine's optimizer (hemiola._C.optim, shared with the parameter server)
against torch.optim: every supported option, float32/float64/bfloat16/float16
parameters, several steps with the learning rate changed between steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hemiola._native import C
from hemiola.engine_tensors import dtype_code
from hemiola.hyper import group_hyper
from hemiola.torch_sqrt import torch_sqrt

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SGD_OPTIONS = [
    {}, {"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.1},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    {"weight_decay": 1e-2, "maximize": True}, {"momentum": 0.5, "maximize": True},
]
ADAM_OPTIONS = [
    ("adam", {}), ("adam", {"weight_decay": 1e-2}), ("adam", {"amsgrad": True}),
    ("adamw", {"weight_decay": 0.1}), ("adamw", {"amsgrad": True, "maximize": True}),
    ("adam", {"betas": (0.8, 0.99), "eps": 1e-6}),
]
STEPS = 4


def _ulps(dtype: torch.dtype) -> float:
    """How far apart torch's SGD and the engine's may end. The engine replays
    torch's ops one by one (measured: bitwise equal but for rare 1-ulp
    differences in the reduced types), so the tolerance is a few units of each
    dtype's rounding, never a loose one."""
    return {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2,
            torch.float16: 2e-3}[dtype]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = _ulps(dtype)
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def _equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit, NaN where torch has NaN (float16's eps=1e-8 rounds to 0,
    so a zero second moment divides by zero in both)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _problem(dtype: torch.dtype, n: int = 257) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    param = torch.randn(n, generator=g).to(dtype)
    grads = [torch.randn(n, generator=g).to(dtype) for _ in range(STEPS)]
    return param, grads


def _lr(step: int) -> float:
    return 0.1 * 0.5**step  # changed between steps, as a scheduler does


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", SGD_OPTIONS, ids=str)
def test_sgd_matches_torch(options: dict[str, Any], dtype: torch.dtype) -> None:
    start, grads = _problem(dtype)
    ref = start.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=_lr(0), **options)
    mine = start.clone()
    buf = torch.zeros_like(mine)
    for step, grad in enumerate(grads):
        opt.param_groups[0]["lr"] = _lr(step)
        ref.grad = grad.clone()
        opt.step()
        C.optim.sgd_step(
            param=mine.data_ptr(), shadow=mine.data_ptr(), momentum_buffer=buf.data_ptr(),
            grad=grad.data_ptr(), numel=mine.numel(), dtype=dtype_code(dtype), device=-1,
            hyper=group_hyper(opt.param_groups[0]), first_step=step == 0, commit=True)
        _close(mine, ref.detach(), dtype)
    if options.get("momentum"):
        _close(buf, opt.state[ref]["momentum_buffer"], dtype)
    assert not torch.equal(mine, start)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,options", ADAM_OPTIONS, ids=str)
def test_adam_and_adamw_match_torch(kind: str, options: dict[str, Any],
                                    dtype: torch.dtype) -> None:
    """Bitwise: the engine takes torch's square root (hemiola.torch_sqrt)."""
    roots = torch_sqrt()
    start, grads = _problem(dtype, n=4099)
    ref = start.clone().requires_grad_()
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = cls([ref], lr=_lr(0), **options)
    mine = start.clone()
    m, v, vmax = (torch.zeros_like(mine) for _ in range(3))
    for step, grad in enumerate(grads):
        opt.param_groups[0]["lr"] = _lr(step)
        ref.grad = grad.clone()
        opt.step()
        C.optim.adam_step(
            param=mine.data_ptr(), shadow=mine.data_ptr(), exp_avg=m.data_ptr(),
            exp_avg_sq=v.data_ptr(), max_exp_avg_sq=vmax.data_ptr(), grad=grad.data_ptr(),
            numel=mine.numel(), dtype=dtype_code(dtype), device=-1,
            hyper=group_hyper(opt.param_groups[0]), decoupled_weight_decay=kind == "adamw",
            step=step + 1, commit=True, sqrt_f32=roots.f32, sqrt_f64=roots.f64)
        _equal(mine, ref.detach(), f"parameters after step {step + 1}")
    state = opt.state[ref]
    _equal(m, state["exp_avg"], "exp_avg")
    _equal(v, state["exp_avg_sq"], "exp_avg_sq")
    if options.get("amsgrad"):
        _equal(vmax, state["max_exp_avg_sq"], "max_exp_avg_sq")


def test_a_step_that_does_not_commit_writes_only_the_live_parameters() -> None:
    # decoupled's approximate step: from the shadow and the state, into param.
    shadow, (grad, *_) = _problem(torch.float32)
    live = torch.full_like(shadow, 7.0)
    m, v = torch.full_like(shadow, 0.1), torch.full_like(shadow, 0.2)
    before = [t.clone() for t in (shadow, m, v)]
    hyper = C.optim.Hyper(lr=0.1)
    C.optim.adam_step(param=live.data_ptr(), shadow=shadow.data_ptr(), exp_avg=m.data_ptr(),
                      exp_avg_sq=v.data_ptr(), max_exp_avg_sq=0, grad=grad.data_ptr(),
                      numel=live.numel(), dtype=dtype_code(torch.float32), device=-1,
                      hyper=hyper, decoupled_weight_decay=False, step=3, commit=False)
    for now, then in zip((shadow, m, v), before):
        assert torch.equal(now, then)
    committed = shadow.clone()
    C.optim.adam_step(param=committed.data_ptr(), shadow=committed.data_ptr(),
                      exp_avg=m.data_ptr(), exp_avg_sq=v.data_ptr(), max_exp_avg_sq=0,
                      grad=grad.data_ptr(), numel=live.numel(), dtype=dtype_code(torch.float32),
                      device=-1, hyper=hyper, decoupled_weight_decay=False, step=3, commit=True)
    assert torch.equal(live, committed)  # the same values, without committing


def test_bad_hyper_parameters_are_refused_like_torch() -> None:
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        C.optim.sgd_step(param=t.data_ptr(), shadow=t.data_ptr(), momentum_buffer=0,
                         grad=t.data_ptr(), numel=4, dtype=dtype_code(torch.float32), device=-1,
                         hyper=C.optim.Hyper(lr=0.1, nesterov=True), first_step=True,
                         commit=True)
    with pytest.raises(ValueError, match="invalid beta2"):
        C.optim.adam_step(param=t.data_ptr(), shadow=t.data_ptr(), exp_avg=t.data_ptr(),
                          exp_avg_sq=t.data_ptr(), max_exp_avg_sq=0, grad=t.data_ptr(), numel=4,
                          dtype=dtype_code(torch.float32), device=-1,
                          hyper=C.optim.Hyper(lr=0.1, beta2=1.0), decoupled_weight_decay=False,
                          step=1, commit=True)
