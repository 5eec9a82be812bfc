"""The unpack kernel's bandwidth against a device-to-device copy of the same bytes.

    python bench/gpu_kernels.py [--repeats 200]

The ResNet-50 parameter set (161 tensors, 25.6M elements) is unpacked from one
fusion buffer (with the 1/world scale, as the engine does) in one launch. A
plain `dst.copy_(src)` of the buffer's bytes is the reference: bandwidth
counts bytes read plus bytes written for both, and the target is >= 80% of
the copy's. Timings are CUDA-event medians after
warm-up. Needs a GPU and a CUDA build of hemiola; writes
bench/results/gpu_kernels.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

from hemiola._native import C
from hemiola.bench.record import DEFAULT_OUT, write_lines

CODES = {
    torch.float32: int(C.DType.float32),
    torch.bfloat16: int(C.DType.bfloat16),
    torch.float16: int(C.DType.float16),
}



def resnet50_shapes() -> list[tuple[int, ...]]:
    """The shapes of resnet50().parameters(), in registration order."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out_ch = width * 4
        for block in range(blocks):
            shapes += [(width, in_ch, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out_ch, width, 1, 1), (out_ch,), (out_ch,)]
            if block == 0:  # the projection shortcut
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    shapes += [(1000, 2048), (1000,)]
    return shapes

def time_ms(launch: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of `launch` on the current stream (CUDA events)."""
    for _ in range(10):
        launch()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(dtype: torch.dtype, repeats: int) -> dict[str, float | str | int]:
    kernels = C.cuda
    tensors = [torch.randn(s, device="cuda").to(dtype) for s in resnet50_shapes()]
    offsets, offset = [], 0
    for t in tensors:  # 256-byte aligned slots, as the engine lays them out
        offsets.append(offset)
        offset += -(-t.numel() * t.element_size() // 256) * 256 // t.element_size()
    extent = offsets[-1] + tensors[-1].numel()
    buffer = torch.randn(extent, device="cuda").to(dtype)
    other = torch.empty_like(buffer)
    slots = torch.tensor(
        [[t.data_ptr(), o, t.numel()] for t, o in zip(tensors, offsets)],
        dtype=torch.int64,
        device="cuda",
    )
    stream = torch.cuda.current_stream().cuda_stream
    code = CODES[dtype]
    payload = sum(t.numel() for t in tensors) * buffer.element_size()

    copy = time_ms(lambda: other.copy_(buffer), repeats)
    unpack = time_ms(
        lambda: kernels.unpack(
            slots.data_ptr(), len(tensors), extent, code, buffer.data_ptr(), 0.25, stream
        ),
        repeats,
    )
    # Correctness guard: what unpack wrote is a quarter of the buffer's slots.
    kernels.unpack(slots.data_ptr(), len(tensors), extent, code, buffer.data_ptr(), 0.25, stream)
    for t, o in zip(tensors, offsets):
        expected = buffer[o:o + t.numel()].float() * 0.25
        torch.testing.assert_close(t.float().reshape(-1), expected)

    def gbps(ms: float, nbytes: int) -> float:
        return 2 * nbytes / (ms * 1e-3) / 1e9

    copy_bw = gbps(copy, buffer.numel() * buffer.element_size())
    return {
        "device": torch.cuda.get_device_name(),
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": len(tensors),
        "bytes": payload,
        "copy_ms": copy,
        "unpack_ms": unpack,
        "copy_gbps": copy_bw,
        "unpack_gbps": gbps(unpack, payload),
        "unpack_fraction": gbps(unpack, payload) / copy_bw,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not hasattr(C, "cuda"):
        sys.exit("needs a CUDA GPU and a CUDA build of hemiola")
    rows = [measure(dtype, args.repeats) for dtype in (torch.float32, torch.bfloat16)]
    print(
        f"{'dtype':9} {'MB':>7} {'copy GB/s':>10} {'unpack GB/s':>12} {'unpack/copy':>12}"
    )
    for r in rows:
        print(
            f"{r['dtype']:9} {r['bytes'] / 1e6:7.1f} {r['copy_gbps']:10.0f}"
            f" {r['unpack_gbps']:12.0f} {r['unpack_fraction']:12.1%}"
        )
    path = write_lines(DEFAULT_OUT / "gpu_kernels.jsonl", rows)
    print("device:", rows[0]["device"], "| written", path)


if __name__ == "__main__":
    main()
