"""The architectures of the published configurations that
:mod:`hemiola.bench.published` predicts (built on the meta device only, for
their FLOPs and gradient sizes): VGG-16 and Inception V3 as torchvision
defines them (Inception V3 without its auxiliary classifier, which
tf_cnn_benchmarks' model does not train by default either), ResNet-101 from
:func:`hemiola.bench.advise_scale.resnet`.
"""

from __future__ import annotations

import torch
from torch import nn


def vgg16(classes: int = 1000) -> nn.Sequential:
    """VGG-16, configuration D (138,357,544 parameters)."""
    layers: list[nn.Module] = []
    cin = 3
    for width in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                  512, 512, 512, "M"):
        if width == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            assert isinstance(width, int)
            layers += [nn.Conv2d(cin, width, 3, padding=1), nn.ReLU()]
            cin = width
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(),
                         nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(),
                         nn.Linear(4096, classes))


def _conv(cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1,
          padding: int | tuple[int, int] = 0) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, padding, bias=False),
                         nn.BatchNorm2d(cout, eps=0.001), nn.ReLU())


class _Branches(nn.Module):
    """Inception's parallel branches, concatenated along the channels."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], 1)


def _pool_branch(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.AvgPool2d(3, 1, 1), _conv(cin, cout, 1))


def _block_a(cin: int, pool: int) -> _Branches:
    return _Branches(_conv(cin, 64, 1),
                     nn.Sequential(_conv(cin, 48, 1), _conv(48, 64, 5, padding=2)),
                     nn.Sequential(_conv(cin, 64, 1), _conv(64, 96, 3, padding=1),
                                   _conv(96, 96, 3, padding=1)),
                     _pool_branch(cin, pool))


def _block_b(cin: int) -> _Branches:
    return _Branches(_conv(cin, 384, 3, 2),
                     nn.Sequential(_conv(cin, 64, 1), _conv(64, 96, 3, padding=1),
                                   _conv(96, 96, 3, 2)),
                     nn.MaxPool2d(3, 2))


def _block_c(cin: int, c7: int) -> _Branches:
    def row(cout: int) -> nn.Sequential:
        return _conv(c7, cout, (1, 7), padding=(0, 3))

    def col(cout: int) -> nn.Sequential:
        return _conv(c7, cout, (7, 1), padding=(3, 0))

    return _Branches(_conv(cin, 192, 1),
                     nn.Sequential(_conv(cin, c7, 1), row(c7), col(192)),
                     nn.Sequential(_conv(cin, c7, 1), col(c7), row(c7), col(c7), row(192)),
                     _pool_branch(cin, 192))


def _block_d(cin: int) -> _Branches:
    return _Branches(nn.Sequential(_conv(cin, 192, 1), _conv(192, 320, 3, 2)),
                     nn.Sequential(_conv(cin, 192, 1), _conv(192, 192, (1, 7), padding=(0, 3)),
                                   _conv(192, 192, (7, 1), padding=(3, 0)),
                                   _conv(192, 192, 3, 2)),
                     nn.MaxPool2d(3, 2))


def _split(cin: int) -> _Branches:
    return _Branches(_conv(cin, 384, (1, 3), padding=(0, 1)),
                     _conv(cin, 384, (3, 1), padding=(1, 0)))


def _block_e(cin: int) -> _Branches:
    return _Branches(_conv(cin, 320, 1),
                     nn.Sequential(_conv(cin, 384, 1), _split(384)),
                     nn.Sequential(_conv(cin, 448, 1), _conv(448, 384, 3, padding=1),
                                   _split(384)),
                     _pool_branch(cin, 192))


def inception_v3(classes: int = 1000) -> nn.Sequential:
    """Inception V3 for 299x299 images, without the auxiliary classifier
    (23,834,568 parameters)."""
    return nn.Sequential(
        _conv(3, 32, 3, 2), _conv(32, 32, 3), _conv(32, 64, 3, padding=1), nn.MaxPool2d(3, 2),
        _conv(64, 80, 1), _conv(80, 192, 3), nn.MaxPool2d(3, 2),
        _block_a(192, 32), _block_a(256, 64), _block_a(288, 64), _block_b(288),
        _block_c(768, 128), _block_c(768, 160), _block_c(768, 160), _block_c(768, 192),
        _block_d(768), _block_e(1280), _block_e(2048),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(), nn.Linear(2048, classes))
