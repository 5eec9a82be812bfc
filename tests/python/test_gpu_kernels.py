"""The CUDA kernels (hemiola._C.cuda, and _C.optim's steps on a GPU) against
float64 torch references.

Every case builds fresh random data of odd sizes; every tensor the kernels see
is a view at an odd element offset inside a larger NaN-filled (for integers:
-1-filled) allocation, so data pointers are misaligned for vector accesses and
the poisoned guard elements around each view show any write out of bounds.
Outputs are poisoned before each launch, so nothing passes by leaving a
previous result in place. Kernels run on a side stream.

The GPU tests skip without a CUDA device or without a CUDA build of hemiola;
the argument checks need only the CUDA build (they raise before any launch).
"""

from __future__ import annotations

import random

import pytest
import torch

from hemiola._native import C

KERNELS = getattr(C, "cuda", None)
needs_cuda_build = pytest.mark.skipif(
    KERNELS is None, reason="hemiola was built without CUDA (no hemiola._C.cuda): rebuild with nvcc"
)


def gpu(test):
    """Marks a test as needing a CUDA GPU and a CUDA build of hemiola."""
    no_gpu = pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False)",
    )
    return pytest.mark.gpu(needs_cuda_build(no_gpu(test)))


CODES = {
    torch.float32: int(C.DType.float32),
    torch.float64: int(C.DType.float64),
    torch.float16: int(C.DType.float16),
    torch.bfloat16: int(C.DType.bfloat16),
    torch.int32: int(C.DType.int32),
}
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# Element-wise error allowed against the float64 reference: a few roundings
# to the storage dtype.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
}
GUARD = 3  # poisoned elements on each side of every view
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Poisoned:
    """`numel` elements at an odd offset inside a poisoned allocation."""

    def __init__(self, numel: int, dtype: torch.dtype, misalign: int) -> None:
        poison = float("nan") if dtype.is_floating_point else -1
        self.storage = torch.full(
            (numel + misalign + 2 * GUARD,), poison, dtype=dtype, device="cuda"
        )
        self.begin = GUARD + misalign
        self.view = self.storage[self.begin : self.begin + numel]

    def fill(self, values: torch.Tensor) -> Poisoned:
        self.view.copy_(values)
        return self

    def ptr(self) -> int:
        return self.view.data_ptr()

    def guards_intact(self) -> bool:
        outside = torch.cat(
            [self.storage[: self.begin], self.storage[self.begin + self.view.numel() :]]
        )
        if outside.dtype.is_floating_point:
            return bool(torch.isnan(outside).all())
        return bool((outside == -1).all())


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t` (so NaNs compare equal to themselves)."""
    return t.contiguous().view(BITS[t.element_size()])


def random_values(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, device="cuda", dtype=torch.float64).to(dtype)
    return torch.randint(-(2**30), 2**30, (numel,), generator=gen, device="cuda", dtype=dtype)


def run_on_side_stream(launch) -> None:
    """Runs launch(stream handle) on a fresh stream once prior work is done; waits for it."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    launch(stream.cuda_stream)
    stream.synchronize()


# ---- fusion ----------------------------------------------------------------

# Sizes around the kernel's chunk (2048 elements) and odd ones, including an
# empty tensor; a chunk then spans several slots, gaps, and partial slots.
FUSION_SIZES = [0, 1, 2, 3, 31, 255, 2047, 2048, 2049, 4099, 6145, 65537]


def fusion_layout(dtype: torch.dtype, seed: int):
    """Tensors at odd offsets and a fusion buffer with random gaps between slots."""
    rng = random.Random(seed)
    sizes = rng.sample(FUSION_SIZES, len(FUSION_SIZES))
    tensors, offsets, offset = [], [], 0
    for numel in sizes:
        offset += rng.randint(0, 3)  # padding between slots is allowed
        tensors.append(Poisoned(numel, dtype, misalign=rng.randint(1, 3)))
        offsets.append(offset)
        offset += numel
    extent = offset
    # 5 elements past the extent that the kernels must not touch.
    buffer = Poisoned(extent + 5, dtype, misalign=1)
    slots = torch.tensor(
        [[t.ptr(), off, t.view.numel()] for t, off in zip(tensors, offsets)],
        dtype=torch.int64,
        device="cuda",
    )
    return tensors, offsets, extent, buffer, slots


@gpu
@pytest.mark.parametrize("scale", [1.0, 1.0 / 3.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [*FLOATS, torch.float64, torch.int32])
def test_unpack_restores_every_slot_scaled(dtype, seed, scale):
    if scale != 1.0 and not dtype.is_floating_point:
        pytest.skip("only floating dtypes are scaled")
    gen = torch.Generator(device="cuda").manual_seed(100 + seed)
    tensors, offsets, extent, buffer, slots = fusion_layout(dtype, seed)
    buffer.fill(random_values(buffer.view.numel(), dtype, gen))
    assert KERNELS.FUSION_SLOT_BYTES == slots.shape[1] * slots.element_size()

    run_on_side_stream(
        lambda s: KERNELS.unpack(
            slots.data_ptr(), len(tensors), extent, CODES[dtype], buffer.ptr(), scale, s
        )
    )

    for t, off in zip(tensors, offsets):
        source = buffer.view[off : off + t.view.numel()]
        if scale == 1.0:
            assert torch.equal(bits(t.view), bits(source))  # a raw copy, bit for bit
        else:
            expected = source.double() * scale
            torch.testing.assert_close(t.view.double(), expected, **TOLERANCE[dtype])
        assert t.guards_intact()


# ---- casts -------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("numel", [1, 7, 4099, 2**24 + 3])  # the last strides the capped grid
@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16])
def test_casts_round_like_torch(narrow, numel):
    gen = torch.Generator(device="cuda").manual_seed(numel)
    # Magnitudes from subnormal to past float16's range (which must become inf).
    values = torch.randn(numel, generator=gen, device="cuda", dtype=torch.float64)
    values *= torch.logspace(-9, 6, numel, device="cuda", dtype=torch.float64)
    wide = Poisoned(numel, torch.float32, misalign=1).fill(values.float())
    short = Poisoned(numel, narrow, misalign=3)
    run_on_side_stream(
        lambda s: KERNELS.cast(
            wide.ptr(), CODES[torch.float32], short.ptr(), CODES[narrow], numel, s
        )
    )
    # A float32 is exact in float64, so torch's cast of its float64 value rounds
    # once, to nearest even: the correctly rounded result.
    assert torch.equal(bits(short.view), bits(wide.view.double().to(narrow)))
    assert short.guards_intact()

    back = Poisoned(numel, torch.float32, misalign=2)
    run_on_side_stream(
        lambda s: KERNELS.cast(
            short.ptr(), CODES[narrow], back.ptr(), CODES[torch.float32], numel, s
        )
    )
    assert torch.equal(back.view.double(), short.view.double())  # widening is exact
    assert back.guards_intact()


@gpu
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0, 8.0])
@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16])
def test_cast_divide_is_the_ddp_hooks_wire_format(narrow, divisor):
    numel = 70_001
    gen = torch.Generator(device="cuda").manual_seed(int(divisor))
    values = torch.randn(numel, generator=gen, device="cuda") * torch.logspace(
        -7, 5, numel, device="cuda")
    wide = Poisoned(numel, torch.float32, misalign=1).fill(values)
    short = Poisoned(numel, narrow, misalign=3)
    run_on_side_stream(
        lambda s: KERNELS.cast_divide(wide.ptr(), short.ptr(), CODES[narrow], numel, divisor, s)
    )
    # torch's hook: the cast rounds, the division in the half type rounds again
    # (computed in float, as the kernel does).
    expected = (values.to(narrow).float() / divisor).to(narrow)
    assert torch.equal(bits(short.view), bits(expected))
    assert short.guards_intact()


# ---- SGD ---------------------------------------------------------------------

SGD_CASES = [
    {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False},
    {"momentum": 0.0, "dampening": 0.0, "weight_decay": 1e-2, "nesterov": False, "maximize": True},
    {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2, "nesterov": False, "maximize": False},
    {"momentum": 0.9, "dampening": 0.0, "weight_decay": 5e-4, "nesterov": True, "maximize": False},
    {"momentum": 0.8, "dampening": 0.0, "weight_decay": 0.0, "nesterov": True, "maximize": True},
]
LR = 0.05


def sgd_step(param, shadow, buffer, grad, numel, dtype, *, first_step, commit, stream, **case):
    """_C.optim.sgd_step on the current CUDA device with lr LR and `case`
    (whose "momentum" is the factor; `buffer` is the momentum buffer)."""
    C.optim.sgd_step(param, shadow, buffer, grad, numel, dtype, torch.cuda.current_device(),
                     C.optim.Hyper(lr=LR, **case), first_step=first_step, commit=commit,
                     stream=stream)


def sgd_reference(w, buf, grad, case, first_step):
    """torch.optim.SGD in float64: (new parameters, new momentum buffer or None)."""
    p = torch.nn.Parameter(w.double().clone())
    p.grad = grad.double().clone()
    opt = torch.optim.SGD([p], lr=LR, foreach=False, **case)
    if case["momentum"] and not first_step:
        opt.state[p]["momentum_buffer"] = buf.double().clone()
    opt.step()
    return p.detach(), opt.state[p].get("momentum_buffer")


class SgdData:
    """Random shadow parameters, momentum buffer and gradients at odd offsets."""

    def __init__(self, numel, dtype, seed, first_step):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.shadow = Poisoned(numel, dtype, 1).fill(random_values(numel, dtype, gen))
        self.grad = Poisoned(numel, dtype, 2).fill(random_values(numel, dtype, gen))
        self.momentum = Poisoned(numel, dtype, 1)
        if not first_step:  # a first step must not read the (poisoned) buffer
            self.momentum.fill(random_values(numel, dtype, gen))
        self.param = Poisoned(numel, dtype, 3)


@gpu
@pytest.mark.parametrize("commit", [False, True])
@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize("case", SGD_CASES)
@pytest.mark.parametrize("numel", [7, 300_001])
@pytest.mark.parametrize("dtype", FLOATS)
def test_sgd_step_matches_torch(dtype, numel, case, first_step, commit):
    d = SgdData(numel, dtype, seed=numel, first_step=first_step)
    shadow_before, momentum_before = d.shadow.view.clone(), d.momentum.view.clone()
    expected_w, expected_buf = sgd_reference(
        d.shadow.view, d.momentum.view, d.grad.view, case, first_step
    )

    run_on_side_stream(
        lambda s: sgd_step(
            d.param.ptr(),
            d.shadow.ptr(),
            d.momentum.ptr(),
            d.grad.ptr(),
            numel,
            CODES[dtype],
            first_step=first_step,
            commit=commit,
            stream=s,
            **case,
        )
    )

    torch.testing.assert_close(d.param.view.double(), expected_w, **TOLERANCE[dtype])
    if commit:
        assert torch.equal(bits(d.shadow.view), bits(d.param.view))
        if case["momentum"]:
            torch.testing.assert_close(d.momentum.view.double(), expected_buf, **TOLERANCE[dtype])
    else:  # an approximate step leaves the shadow state alone
        assert torch.equal(bits(d.shadow.view), bits(shadow_before))
        assert torch.equal(bits(d.momentum.view), bits(momentum_before))
    for t in (d.param, d.shadow, d.momentum, d.grad):
        assert t.guards_intact()


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_sgd_commit_in_place(dtype):
    """Live parameters and shadow may be the same memory: torch's own in-place step."""
    numel, case = 4099, SGD_CASES[3]
    d = SgdData(numel, dtype, seed=7, first_step=False)
    expected_w, expected_buf = sgd_reference(
        d.shadow.view, d.momentum.view, d.grad.view, case, False
    )
    run_on_side_stream(
        lambda s: sgd_step(
            d.shadow.ptr(),
            d.shadow.ptr(),
            d.momentum.ptr(),
            d.grad.ptr(),
            numel,
            CODES[dtype],
            first_step=False,
            commit=True,
            stream=s,
            **case,
        )
    )
    torch.testing.assert_close(d.shadow.view.double(), expected_w, **TOLERANCE[dtype])
    torch.testing.assert_close(d.momentum.view.double(), expected_buf, **TOLERANCE[dtype])


# ---- Adam / AdamW -----------------------------------------------------------

ADAM_CASES = [
    {"weight_decay": 0.0, "decoupled_weight_decay": False, "maximize": False},
    {"weight_decay": 1e-2, "decoupled_weight_decay": False, "maximize": False},  # Adam, L2
    {"weight_decay": 1e-2, "decoupled_weight_decay": True, "maximize": False},  # AdamW
    {"weight_decay": 0.0, "decoupled_weight_decay": False, "maximize": True},
]
ADAM = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}


def adam_step(param, shadow, exp_avg, exp_avg_sq, grad, numel, dtype, *,
              decoupled_weight_decay, step, commit, stream, **group):
    """_C.optim.adam_step on the current CUDA device (no amsgrad buffer)."""
    C.optim.adam_step(param, shadow, exp_avg, exp_avg_sq, 0, grad, numel, dtype,
                      torch.cuda.current_device(), C.optim.Hyper(**group),
                      decoupled_weight_decay=decoupled_weight_decay, step=step, commit=commit,
                      stream=stream)


def adam_reference(w, m, v, grad, case, step):
    """torch.optim.Adam/AdamW in float64 from the given state: (w, m, v) after `step`."""
    p = torch.nn.Parameter(w.double().clone())
    p.grad = grad.double().clone()
    optimizer = torch.optim.AdamW if case["decoupled_weight_decay"] else torch.optim.Adam
    opt = optimizer(
        [p],
        lr=ADAM["lr"],
        betas=(ADAM["beta1"], ADAM["beta2"]),
        eps=ADAM["eps"],
        weight_decay=case["weight_decay"],
        maximize=case["maximize"],
        foreach=False,
    )
    opt.state[p] = {
        "step": torch.tensor(float(step - 1)),
        "exp_avg": m.double().clone(),
        "exp_avg_sq": v.double().clone(),
    }
    opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


def adam_param_from_moments(w, m, v, case, step):
    """The parameter torch's Adam step computes from the new moments `m`, `v`, in float64.

    torch stores the moments in the parameter's dtype before it reads them
    back, and so does the kernel; where float16 moments are subnormal that
    rounding changes the parameter far beyond float16's epsilon. So the
    parameter's reference is this formula applied to the moments rounded to
    the storage dtype; test_adam_formula_is_torchs checks that on unrounded
    moments it is torch's own step.
    """
    w = w.double()
    if case["decoupled_weight_decay"]:
        w = w * (1 - ADAM["lr"] * case["weight_decay"])
    bias1 = 1 - ADAM["beta1"] ** step
    bias2 = 1 - ADAM["beta2"] ** step
    denom = v.double().sqrt() / bias2**0.5 + ADAM["eps"]
    return w - ADAM["lr"] / bias1 * m.double() / denom


@gpu
@pytest.mark.parametrize("commit", [False, True])
@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("case", ADAM_CASES)
@pytest.mark.parametrize("numel", [7, 300_001])
@pytest.mark.parametrize("dtype", FLOATS)
def test_adam_step_matches_torch(dtype, numel, case, step, commit):
    gen = torch.Generator(device="cuda").manual_seed(numel + step)
    shadow = Poisoned(numel, dtype, 1).fill(random_values(numel, dtype, gen))
    grad = Poisoned(numel, dtype, 2).fill(random_values(numel, dtype, gen))
    exp_avg = Poisoned(numel, dtype, 3).fill(0.1 * random_values(numel, dtype, gen))
    exp_avg_sq = Poisoned(numel, dtype, 1).fill(0.01 * random_values(numel, dtype, gen) ** 2)
    param = Poisoned(numel, dtype, 2)
    before = [bits(t.view).clone() for t in (shadow, exp_avg, exp_avg_sq)]
    expected = adam_reference(shadow.view, exp_avg.view, exp_avg_sq.view, grad.view, case, step)
    # From the state before the step (committing overwrites the shadow).
    stored_m, stored_v = expected[1].to(dtype), expected[2].to(dtype)
    expected_param = adam_param_from_moments(shadow.view, stored_m, stored_v, case, step)

    run_on_side_stream(
        lambda s: adam_step(
            param.ptr(),
            shadow.ptr(),
            exp_avg.ptr(),
            exp_avg_sq.ptr(),
            grad.ptr(),
            numel,
            CODES[dtype],
            **ADAM,
            **case,
            amsgrad=False,
            step=step,
            commit=commit,
            stream=s,
        )
    )

    torch.testing.assert_close(param.view.double(), expected_param, **TOLERANCE[dtype])
    state = (shadow, exp_avg, exp_avg_sq)
    if commit:
        assert torch.equal(bits(shadow.view), bits(param.view))
        torch.testing.assert_close(exp_avg.view.double(), expected[1], **TOLERANCE[dtype])
        torch.testing.assert_close(exp_avg_sq.view.double(), expected[2], **TOLERANCE[dtype])
    else:  # the approximate step reads the shadow state and commits nothing
        for t, old in zip(state, before):
            assert torch.equal(bits(t.view), old)
    for t in (param, grad, *state):
        assert t.guards_intact()


@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("case", ADAM_CASES)
def test_adam_formula_is_torchs(case, step):
    """adam_param_from_moments (the fused step's parameter reference) is torch's step."""
    gen = torch.Generator().manual_seed(step)
    w, grad = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    m, v = 0.1 * torch.randn(1000, generator=gen), 0.01 * torch.randn(1000, generator=gen) ** 2
    p, new_m, new_v = adam_reference(w, m, v, grad, case, step)
    formula = adam_param_from_moments(w, new_m, new_v, case, step)
    torch.testing.assert_close(formula, p, rtol=1e-12, atol=1e-12)


# ---- argument checks: raised on the host, before any launch -------------------


@needs_cuda_build
def test_refusals_need_no_gpu():
    """The GPU steps' and kernels' own checks, raised on the host before any
    launch (one element at a bogus address on device 0: nothing reads it)."""
    f32, f16, bf16, i32, f64 = (
        CODES[t] for t in (torch.float32, torch.float16, torch.bfloat16, torch.int32,
                           torch.float64)
    )
    bogus = (8, 8, 8, 8)  # param, shadow, state, grad
    adam = {"decoupled_weight_decay": False, "commit": False, "stream": 0}
    with pytest.raises(ValueError, match="amsgrad"):
        C.optim.adam_step(*bogus, 8, 8, 1, f32, 0, C.optim.Hyper(lr=0.1, amsgrad=True),
                          step=1, **adam)
    with pytest.raises(ValueError, match="float64|unsupported dtype"):
        C.optim.adam_step(*bogus, 0, 8, 1, f64, 0, C.optim.Hyper(lr=0.1), step=1, **adam)
    with pytest.raises(ValueError, match="not a floating dtype"):
        C.optim.sgd_step(*bogus, 1, i32, 0, C.optim.Hyper(lr=0.1), first_step=False,
                         commit=False)
    with pytest.raises(ValueError, match="unsupported conversion"):
        KERNELS.cast(0, f16, 0, bf16, 0, 0)
    with pytest.raises(ValueError, match="cannot scale"):
        KERNELS.unpack(0, 0, 0, i32, 0, 0.5, 0)
