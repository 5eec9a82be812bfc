"""The engine's GPU path: CUDA reducers over NCCL and over Gloo with staged
CUDA tensors, the schedules on a GPU against the same runs on the CPU, and
the stream contract (the engine never makes the host wait for the user's
stream, and its results are ordered on that stream).

Skips without a CUDA GPU or without a CUDA build. One GPU means NCCL runs one
rank; several ranks share the GPU through gpu_backend="gloo".
"""

from __future__ import annotations

import time

import pytest
import torch

from hemiola._native import C
from hemiola.engine_tensors import device_view, model_device
from hemiola.launch import run_local

import workers

HAS_CUDA_BUILD = hasattr(C, "cuda")
HAS_NCCL = "nccl: yes" in C.build_info()


def gpu(test):
    """Marks a test as needing a CUDA GPU and a CUDA build of hemiola."""
    no_build = pytest.mark.skipif(
        not HAS_CUDA_BUILD, reason="hemiola was built without CUDA: rebuild with nvcc"
    )
    no_gpu = pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False)",
    )
    return pytest.mark.gpu(no_build(no_gpu(test)))


def backends() -> list[object]:
    nccl = pytest.param(
        "nccl", marks=pytest.mark.skipif(not HAS_NCCL, reason="no NCCL in this build")
    )
    return [nccl, "gloo"]


F32 = int(C.DType.float32)
F64 = int(C.DType.float64)
SLEEP_CYCLES = 2_000_000_000  # about a second of GPU time at H100 clocks


@gpu
@pytest.mark.parametrize("backend", backends())
def test_wait_never_blocks_the_host_on_the_users_stream(backend: str) -> None:
    """Gradients are produced behind a long kernel on a side stream. The
    engine must copy them only once they exist (its stream waits on events).
    Over NCCL, wait() must return to the host while that kernel still runs,
    leaving the stream to wait on the device. (Over Gloo the engine thread
    must have the bytes on the host, so it waits for them: only correctness
    is checked.)"""
    engine = C.Engine(0, 1, C.MemoryStore(), gpu_backend=backend)
    sizes = [3, 4099, 65537, 1 << 20]
    reducer = engine.make_reducer(
        [(F32, n, f"g{i}") for i, n in enumerate(sizes)],
        fusion_bytes=1 << 20,
        first_bucket_bytes=1 << 14,
        device=0,
    )
    stream = torch.cuda.Stream()
    grads = [torch.ones(n, device="cuda") for n in sizes]
    # A first iteration, with the same kernels, gets one-time work out of the
    # way: CUDA loads a kernel's module at its first launch, and loading while
    # the device is busy waits for it (the host would wait, though not for us).
    with torch.cuda.stream(stream):
        for i, g in enumerate(grads):
            g.mul_(1)
            reducer.mark_ready(i, g.data_ptr(), stream=stream.cuda_stream)
        reducer.wait(reducer.finish_marking(), stream=stream.cuda_stream)
        for g in grads:
            g.add_(0)
        torch.cuda._sleep(1)
        torch.cuda.Event().record(stream)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start = time.perf_counter()
        torch.cuda._sleep(SLEEP_CYCLES)
        slept = torch.cuda.Event()
        slept.record(stream)
        # The gradients' final values exist only after the sleep.
        for i, g in enumerate(grads):
            g.mul_(i + 2)
        phases = {"launch": time.perf_counter()}  # of the sleep and the multiplies
        for i, g in enumerate(grads):
            reducer.mark_ready(i, g.data_ptr(), stream=stream.cuda_stream)
        phases["mark"] = time.perf_counter()
        iteration = reducer.finish_marking()
        reducer.wait(iteration, stream=stream.cuda_stream)
        phases["wait"] = time.perf_counter()
        still_sleeping = not slept.query()
        for g in grads:  # reads of the result, ordered after it on the stream
            g.add_(1)
    stream.synchronize()
    spent = {k: f"{t - start:.3f} s" for k, t in phases.items()}
    if backend == "nccl":
        assert still_sleeping, f"the host waited for the user's stream: {spent}"
    for i, g in enumerate(grads):
        # A copy taken before the multiply would have written back 1 + 1.
        assert torch.equal(g, torch.full_like(g, i + 3)), i


def staged_variants() -> list[object]:
    """The backends, and Gloo pipelined in 4 KiB chunks (bucket sizes are no
    multiple of it, a bucket spans more chunks than the ring has stages, and
    the ring carries over from one bucket to the next)."""
    nccl = pytest.param(
        "nccl", 0, marks=pytest.mark.skipif(not HAS_NCCL, reason="no NCCL in this build")
    )
    return [nccl, ("gloo", 0), ("gloo", 4096)]


@gpu
@pytest.mark.parametrize("backend,chunk", staged_variants())
def test_bucket_results_in_place_and_kept(backend: str, chunk: int) -> None:
    """mark_ready_to with and without an output: results unpacked into the
    outputs (one fused launch per bucket) and kept in the device buckets."""
    engine = C.Engine(0, 1, C.MemoryStore(), gpu_backend=backend, staged_chunk_bytes=chunk)
    sizes = [5, 2049, 7, 30001]
    reducer = engine.make_reducer(
        [(F32, n, f"g{i}") for i, n in enumerate(sizes)],
        fusion_bytes=64 << 10,
        first_bucket_bytes=8 << 10,
        device=0,
        in_flight=1,
    )
    stream = torch.cuda.current_stream().cuda_stream
    for step in range(3):  # outputs change between iterations: slots re-uploaded
        sources = [torch.randn(n, device="cuda") for n in sizes]
        outs = [torch.full((n,), float("nan"), device="cuda") for n in sizes]
        for i, src in enumerate(sources):
            out = outs[i].data_ptr() if i % 2 == 0 else 0
            reducer.mark_ready_to(i, src.data_ptr(), out, stream=stream)
        iteration = reducer.finish_marking()
        reducer.wait(iteration, stream=stream)
        for i, src in enumerate(sources):
            if i % 2 == 0:
                assert torch.equal(outs[i], src), (step, i)
            kept = device_view(reducer.result_ptr(iteration, i), src)
            assert torch.equal(kept, src), (step, i)


@gpu
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_half_wire_on_the_gpu(backend: str, compression: str) -> None:
    """compression='fp16'/'bf16' on a CUDA reducer: float32 buckets travel in
    the half type as DDP's hooks send them (one rank: the result is the
    gradient rounded to it); a float64 bucket travels as it is."""
    from hemiola.config import compression_code

    half = torch.float16 if compression == "fp16" else torch.bfloat16
    engine = C.Engine(0, 1, C.MemoryStore(), gpu_backend=backend)
    sizes = [5, 2049, 30001]
    specs = [(F32, n, f"g{i}") for i, n in enumerate(sizes)] + [(F64, 9, "d")]
    reducer = engine.make_reducer(specs, fusion_bytes=64 << 10, first_bucket_bytes=8 << 10,
                                  device=0, in_flight=1,
                                  compression=compression_code(compression))
    stream = torch.cuda.current_stream().cuda_stream
    for step in range(2):
        sources = [torch.randn(n, device="cuda") * 1e3 for n in sizes]
        sources.append(torch.randn(9, device="cuda", dtype=torch.float64) / 3)
        outs = [torch.full_like(src, float("nan")) for src in sources]
        for i, src in enumerate(sources):
            reducer.mark_ready_to(i, src.data_ptr(), outs[i].data_ptr(), stream=stream)
        reducer.wait(reducer.finish_marking(), stream=stream)
        for i, src in enumerate(sources[:-1]):
            assert torch.equal(outs[i], src.to(half).float()), (step, i)
        assert torch.equal(outs[-1], sources[-1]), step


# decoupled lands corrections when reductions arrive, which depends on timing
# (GPU and CPU differ): compared with correct_on_arrival=False, which makes
# the trajectory timing-independent; its on-arrival path on the GPU is
# checked against wfbp below.
SCHEDULES = ["wfbp", "priority", "decoupled-on-bound"]
#: with the engine's updater on the GPU (the default; the names without
#: -native step with torch's optimizer, native_optimizer=False)
NATIVE = ["priority-native", "decoupled-on-bound-native"]


@gpu
@pytest.mark.parametrize("schedule", SCHEDULES + NATIVE)
@pytest.mark.parametrize(
    "model,optimizer", [("mlp", "sgd"), ("cnn", "nesterov"), ("transformer", "adamw")]
)
def test_schedules_on_one_gpu_with_nccl_match_the_cpu(
    schedule: str, model: str, optimizer: str
) -> None:
    if not HAS_NCCL:
        pytest.skip("no NCCL in this build")
    schedule, native = schedule.removesuffix("-native"), schedule.endswith("-native")
    results = run_local(
        workers.gpu_matches_cpu, 1, schedule, model, optimizer, 6, "nccl", native, timeout_s=240
    )
    r = results[0]
    assert r["moved"] > 1e-3, r  # training did change the parameters
    assert r["max_param_diff"] < 1e-4, r
    assert r["max_loss_diff"] < 1e-4, r


@gpu
@pytest.mark.parametrize("schedule", SCHEDULES + NATIVE)
@pytest.mark.parametrize("model,optimizer", [("cnn", "sgd"), ("transformer", "adamw")])
def test_three_ranks_sharing_the_gpu_through_gloo_match_the_cpu(
    schedule: str, model: str, optimizer: str
) -> None:
    # Every rank sees its own shard: the reductions matter.
    schedule, native = schedule.removesuffix("-native"), schedule.endswith("-native")
    results = run_local(
        workers.gpu_matches_cpu, 3, schedule, model, optimizer, 6, "gloo", native, timeout_s=300
    )
    for rank, r in results.items():
        assert r["moved"] > 1e-3, (rank, r)
        assert r["max_param_diff"] < 1e-4, (rank, r)
        assert r["max_loss_diff"] < 1e-4, (rank, r)


@gpu
@pytest.mark.parametrize("schedule", ["wfbp", "priority-native", "decoupled-on-bound-native"])
def test_pipelined_staging_matches_the_cpu(schedule: str, monkeypatch) -> None:
    """HEMIOLA_STAGED_CHUNK_MB: three ranks share the GPU through Gloo with
    every reduction pipelined in 10 KiB chunks, against the CPU run
    (`decoupled` lands on the bound, so its trajectory does not depend on
    when a reduction arrives; see SCHEDULES)."""
    monkeypatch.setenv("HEMIOLA_STAGED_CHUNK_MB", str(10 / 1024))
    schedule, native = schedule.removesuffix("-native"), schedule.endswith("-native")
    results = run_local(
        workers.gpu_matches_cpu, 3, schedule, "cnn", "sgd", 6, "gloo", native, timeout_s=300
    )
    for rank, r in results.items():
        assert r["moved"] > 1e-3, (rank, r)
        assert r["max_param_diff"] < 1e-4, (rank, r)
        assert r["max_loss_diff"] < 1e-4, (rank, r)


@gpu
@pytest.mark.parametrize("schedule", ["priority", "decoupled"])
@pytest.mark.parametrize("model,optimizer", [("cnn", "sgd"), ("transformer", "adamw")])
def test_multi_tensor_launches_equal_a_launch_per_parameter(
    schedule: str, model: str, optimizer: str
) -> None:
    """HEMIOLA_MULTI_TENSOR_STEPS on the GPU: the batched kernels run the
    single-tensor kernels' arithmetic per element, so the runs agree bit for
    bit (one rank, NCCL if built, else Gloo)."""
    backend = "nccl" if HAS_NCCL else "gloo"
    results = run_local(
        workers.multi_tensor_steps_agree, 1, schedule, model, optimizer, 5, "cuda", backend,
        timeout_s=240
    )
    for rank, r in results.items():
        # Two runs without the switch first: unless they agree, the
        # comparison below says nothing about the batched kernels.
        assert r["repeat"] == {"max_param_diff": 0.0, "max_loss_diff": 0.0}, (rank, r)
        assert r["max_param_diff"] == 0.0, (rank, r)
        assert r["max_loss_diff"] == 0.0, (rank, r)


@gpu
@pytest.mark.parametrize("schedule", ["priority", "decoupled"])
@pytest.mark.parametrize("model,optimizer", [("cnn", "sgd"), ("transformer", "adamw")])
def test_clipping_on_the_device_matches_the_cpu(
    schedule: str, model: str, optimizer: str, monkeypatch
) -> None:
    """HEMIOLA_DEVICE_CLIP: clip_grad_norm_'s coefficient computed on the
    GPU and read there by the steps, against the CPU's (computed on the
    host); three ranks on different data, clipped hard enough to bite."""
    monkeypatch.setenv("HEMIOLA_DEVICE_CLIP", "1")
    results = run_local(
        workers.gpu_clipped_matches_cpu, 3, schedule, model, optimizer, 6, "gloo", 0.05,
        timeout_s=300
    )
    for rank, r in results.items():
        assert r["moved"] > 1e-3, (rank, r)
        assert r["max_param_diff"] < 1e-4, (rank, r)
        assert r["max_loss_diff"] < 1e-4, (rank, r)


@gpu
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("backend", backends())
def test_decoupled_on_the_gpu_equals_wfbp_when_every_rank_sees_the_same_data(
    backend: str, native: bool
) -> None:
    # With the same batch everywhere the local gradient is the average, so
    # the approximate step is exact whenever corrections land.
    world = 1 if backend == "nccl" else 2
    results = run_local(
        workers.gpu_schedules_agree, world, "transformer", "adamw", 6, backend, native,
        timeout_s=240
    )
    for rank, r in results.items():
        assert r["max_param_diff"] < 1e-5, (rank, r)
        assert r["max_loss_diff"] < 1e-4, (rank, r)


@gpu
def test_buffers_are_packed_on_the_gpu_and_come_back() -> None:
    """pack_bytes packs GPU tensors on the device and copies them off once;
    unpack_bytes copies the bytes on once: the same bytes as the CPU path."""
    from hemiola.engine_tensors import pack_bytes, unpack_bytes

    torch.manual_seed(0)
    cpu = [torch.randn(3, 5), torch.arange(7), torch.randn(11).half(), torch.tensor(5),
           torch.randn(2, 3, dtype=torch.float64)]
    gpu = [t.cuda() for t in cpu]
    flat, offsets = pack_bytes(gpu)
    assert torch.equal(flat, pack_bytes(cpu)[0])
    targets = [torch.zeros_like(t) for t in gpu]
    unpack_bytes(flat, offsets, targets)
    assert all(torch.equal(a, b) for a, b in zip(gpu, targets))


@gpu
def test_a_model_on_two_devices_is_refused_with_what_to_do() -> None:
    a = torch.nn.Linear(2, 2)
    b = torch.nn.Linear(2, 2).cuda()
    named = [*a.named_parameters(prefix="a"), *b.named_parameters(prefix="b")]
    with pytest.raises(ValueError, match="several devices.*one device"):
        model_device(named)


@gpu
def test_a_host_gradient_given_to_a_cuda_reducer_is_named() -> None:
    engine = C.Engine(0, 1, C.MemoryStore(), gpu_backend="gloo")
    reducer = engine.make_reducer([(F32, 10, "layer.weight")], 1 << 20, 1 << 20, device=0)
    host = torch.ones(10)
    with pytest.raises(ValueError, match="'layer.weight' is on the host but the reducer is on"):
        reducer.mark_ready(0, host.data_ptr(), stream=torch.cuda.current_stream().cuda_stream)
