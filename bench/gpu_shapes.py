"""Parameter shapes of ResNet-50 (torchvision's layout), without torchvision.

The GPU benchmarks use them as the "ResNet-50-sized parameter set" of the
issue: 161 tensors, 25,557,032 parameters, from 64-element batch-norm vectors
to the 2,048,000-element classifier.
"""

from __future__ import annotations

import math


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


def total_numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


if __name__ == "__main__":
    s = resnet50_shapes()
    print(len(s), "tensors,", total_numel(s), "parameters")
