"""The engine's optimizer step (hemiola/optimizer.h) against torch.optim's on
the CPU: milliseconds per step of one large float32 tensor, one thread each.

    python bench/optimizer.py [--numel 4000000] [--steps 10]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from hemiola._native import C
from hemiola.engine_tensors import dtype_code
from hemiola.hyper import group_hyper
from hemiola.torch_sqrt import torch_sqrt


def _time(step: Callable[[int], None], steps: int) -> float:
    step(0)  # warm-up (and the step that creates the state)
    start = time.perf_counter()
    for k in range(1, steps + 1):
        step(k)
    return (time.perf_counter() - start) / steps * 1e3


def _compare(name: str, n: int, steps: int) -> tuple[float, float]:
    """(torch ms, hemiola ms) per step of `name` over `n` float32 elements."""
    f32 = dtype_code(torch.float32)
    roots = torch_sqrt()
    param, grad = torch.randn(n), torch.randn(n)
    a, b = torch.zeros(n), torch.zeros(n)
    ref = param.clone().requires_grad_()
    ref.grad = grad.clone()
    opt = (torch.optim.SGD([ref], lr=0.01, momentum=0.9) if name == "sgd-momentum"
           else torch.optim.Adam([ref], lr=0.01))

    hyper = group_hyper(opt.param_groups[0])

    def native(k: int) -> None:
        if name == "sgd-momentum":
            C.optim.sgd_step(
                param=param.data_ptr(), shadow=param.data_ptr(), momentum_buffer=a.data_ptr(),
                grad=grad.data_ptr(), numel=n, dtype=f32, device=-1, hyper=hyper,
                first_step=k == 0, commit=True)
        else:
            C.optim.adam_step(
                param=param.data_ptr(), shadow=param.data_ptr(), exp_avg=a.data_ptr(),
                exp_avg_sq=b.data_ptr(), max_exp_avg_sq=0, grad=grad.data_ptr(), numel=n,
                dtype=f32, device=-1, hyper=hyper, decoupled_weight_decay=False,
                step=k + 1, commit=True, sqrt_f32=roots.f32)  # torch's root, as the updater

    return _time(lambda k: opt.step(), steps), _time(native, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'optimizer':<16} {'torch ms':>9} {'hemiola ms':>11}   "
          f"({args.numel} float32, 1 thread)")
    for name in ("sgd-momentum", "adam"):
        torch_ms, ours_ms = _compare(name, args.numel, args.steps)
        print(f"{name:<16} {torch_ms:>9.1f} {ours_ms:>11.1f}")


if __name__ == "__main__":
    main()
