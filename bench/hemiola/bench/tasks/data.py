"""The data of the convergence tasks, all made on the spot (no download).

- ``load_corpus``: the text of Python's own language reference as shipped in
  the standard library (``pydoc_data.topics``: ~466 KB), for the byte-level LM;
- ``load_source``: the first million characters of the standard library's own
  top-level modules (``Lib/*.py`` in name order), for the character-level GPT;
- ``load_packages``: the standard library's packages (``Lib/<package>/**/*.py``,
  their tests, ``pydoc_data`` and the codec tables left out: ~5 MB), for the
  10M-parameter byte-level LM;
- ``load_shapes``: a structured synthetic 10-class image task (shapes in random
  colours, positions and sizes, a low-contrast distractor, pixel noise).

``corpus_info``, ``source_info``, ``packages_info`` and ``shapes_info`` fingerprint
them for the results file.
scikit-learn's digits come from ``hemiola.demo.load_digits``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch


def load_corpus() -> bytes:
    """The text of Python's language reference (``pydoc_data.topics``) as UTF-8.

    The topics are joined in sorted order, so the bytes are the same on every
    call for a given Python version (``corpus_info`` records which).
    """
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


def corpus_info() -> dict[str, Any]:
    """Where the corpus came from and its fingerprint, for the results file."""
    import sys

    data = load_corpus()
    return {"corpus": "pydoc_data.topics", "python": sys.version.split()[0],
            "corpus_bytes": len(data), "corpus_sha256": hashlib.sha256(data).hexdigest()[:16]}


#: characters of ``load_source``: about 1 MB, like nanoGPT's Shakespeare
SOURCE_CHARS = 1_000_000


def load_source(chars: int = SOURCE_CHARS) -> str:
    """The first `chars` characters of this Python's standard-library modules
    (``Lib/*.py``, in name order, each ending in a newline): a corpus every
    machine with Python has, unlike the language reference (``load_corpus``)
    in kind, for the character-level task."""
    import sysconfig
    from pathlib import Path

    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8")
        parts.append(text)
        size += len(text)
        if size >= chars:
            break
    return "".join(parts)[:chars]


def source_info() -> dict[str, Any]:
    """Where the character-level corpus came from and its fingerprint."""
    import sys

    text = load_source()
    return {"corpus": "stdlib Lib/*.py", "python": sys.version.split()[0],
            "corpus_chars": len(text), "vocabulary": len(set(text)),
            "corpus_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]}


#: packages of the standard library left out of ``load_packages``: the
#: language reference is the byte LM's corpus (``load_corpus``), the codecs are
#: tables, not prose or code, and the rest is not Python's library
PACKAGES_LEFT_OUT = ("pydoc_data", "encodings", "site-packages", "idlelib", "lib2to3",
                     "turtledemo", "__phello__")


def load_packages() -> bytes:
    """The standard library's packages as UTF-8: every ``Lib/<package>/**/*.py``
    in path order, each followed by a newline, without test directories
    (``test``, ``tests``, ``test_*``) or ``PACKAGES_LEFT_OUT``. None of it is
    in ``load_corpus`` or ``load_source`` (top-level modules only), so a model
    tuned on those meets it new."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for path in sorted(root.glob("*/**/*.py")):
        dirs = path.relative_to(root).parts[:-1]
        if dirs[0] in PACKAGES_LEFT_OUT or dirs[0].startswith("config-") or any(
                d in ("test", "tests") or d.startswith("test_") for d in dirs):
            continue
        parts.append(path.read_bytes() + b"\n")
    return b"".join(parts)


def packages_info() -> dict[str, Any]:
    """Where the packages corpus came from and its fingerprint."""
    import sys

    data = load_packages()
    return {"corpus": "stdlib Lib/<package>/**/*.py", "python": sys.version.split()[0],
            "corpus_bytes": len(data), "corpus_sha256": hashlib.sha256(data).hexdigest()[:16]}


#: The classes of ``load_shapes``: each is inside/outside in the shape's own
#: frame (u to the right, v downwards; a shape spans about [-1, 1]^2).
SHAPES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "disc": lambda u, v: u * u + v * v <= 1.0,
    "square": lambda u, v: torch.maximum(u.abs(), v.abs()) <= 0.8,
    "triangle": lambda u, v: (v <= 0.75) & (u.abs() <= 0.55 * (v + 0.95)),
    "plus": lambda u, v: (((u.abs() <= 0.28) | (v.abs() <= 0.28))
                          & (torch.maximum(u.abs(), v.abs()) <= 0.95)),
    "ring": lambda u, v: (u * u + v * v <= 1.0) & (u * u + v * v >= 0.3),
    "horizontal bar": lambda u, v: (u.abs() <= 1.0) & (v.abs() <= 0.32),
    "vertical bar": lambda u, v: (u.abs() <= 0.32) & (v.abs() <= 1.0),
    "diamond": lambda u, v: u.abs() + v.abs() <= 1.05,
    "L": lambda u, v: (((u >= -0.8) & (u <= -0.3) & (v.abs() <= 0.9))
                       | ((v >= 0.4) & (v <= 0.9) & (u.abs() <= 0.8))),
    "X": lambda u, v: ((((u - v).abs() <= 0.38) | ((u + v).abs() <= 0.38))
                       & (torch.maximum(u.abs(), v.abs()) <= 0.85)),
}


def draw_shapes(kinds: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, size: torch.Tensor,
                angle: torch.Tensor, res: int) -> torch.Tensor:
    """Masks (n, 1, res, res) of one shape per image: kind (an index into
    ``SHAPES``), centre in pixels, half-width in pixels, rotation in radians."""
    n = len(kinds)
    grid = torch.arange(res, dtype=torch.float32) + 0.5
    x = grid.view(1, 1, res) - cx.view(n, 1, 1)
    y = grid.view(1, res, 1) - cy.view(n, 1, 1)
    cos, sin, scale = angle.cos().view(n, 1, 1), angle.sin().view(n, 1, 1), size.view(n, 1, 1)
    u, v = (cos * x + sin * y) / scale, (cos * y - sin * x) / scale
    masks = torch.zeros(n, res, res, dtype=torch.bool)
    for kind, inside in enumerate(SHAPES.values()):
        mine = kinds == kind
        masks[mine] = inside(u[mine], v[mine])
    return masks.unsqueeze(1).float()


def offset_colours(background: torch.Tensor, low: float, high: float,
                   g: torch.Generator) -> torch.Tensor:
    """For each RGB colour in `background` (n, 3), in [0, 1], a random colour at a
    distance drawn from [low, high] (less where a channel is clipped)."""
    direction = torch.randn(background.shape, generator=g)
    # away from the nearer end of each channel, so that little is clipped
    direction = (-direction.abs() * torch.sign(background - 0.5)
                 / direction.norm(dim=1, keepdim=True))
    distance = low + (high - low) * torch.rand(len(background), 1, generator=g)
    return (background + distance * direction).clamp(0.0, 1.0)


def load_shapes(train: int = 6000, test: int = 1500, res: int = 24, noise: float = 0.2,
                sizes: tuple[float, float] = (3.5, 7.5), faint: tuple[float, float] = (0.1, 0.2),
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A synthetic 10-class image task: which of ``SHAPES`` is in the picture.

    Each RGB image (3 x res x res) holds one shape of its class (half-width
    drawn from `sizes`, in pixels; rotated by up to 0.3 rad; inside the image)
    in a random foreground colour on a random background colour (RGB distance
    0.3-0.7), over a smaller low-contrast distractor of a random kind
    (half-width 2-4.5 pixels, RGB distance from the background drawn from
    `faint`, any rotation, anywhere, possibly clipped), plus Gaussian pixel
    noise of std `noise`. Each image is then standardised per channel, so that
    neither colour nor brightness carries information about the class.
    Deterministic in `seed`; returns x_train, y_train, x_test, y_test.
    """
    g = torch.Generator().manual_seed(seed)
    n = train + test

    def uniform(low: float | torch.Tensor, high: float | torch.Tensor) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=g)

    y = torch.randint(len(SHAPES), (n,), generator=g)
    size = uniform(*sizes)
    margin = size  # a shape turned by <= 0.3 rad spans about +-1.05 of its size
    shape = draw_shapes(y, uniform(margin, res - margin), uniform(margin, res - margin),
                        size, uniform(-0.3, 0.3), res)
    distractor = draw_shapes(torch.randint(len(SHAPES), (n,), generator=g), uniform(0, res),
                             uniform(0, res), uniform(2.0, 4.5), uniform(-math.pi, math.pi), res)
    background = torch.rand(n, 3, generator=g)
    foreground = offset_colours(background, 0.3, 0.7, g).view(n, 3, 1, 1)
    faint_colour = offset_colours(background, *faint, g).view(n, 3, 1, 1)
    x = torch.lerp(background.view(n, 3, 1, 1).expand(n, 3, res, res), faint_colour, distractor)
    x = torch.lerp(x, foreground, shape)
    x = x + noise * torch.randn(n, 3, res, res, generator=g)
    x = (x - x.mean((2, 3), keepdim=True)) / (x.std((2, 3), keepdim=True) + 0.05)
    return x[:train], y[:train], x[train:], y[train:]


def shapes_info() -> dict[str, Any]:
    """A fingerprint of ``load_shapes()``, for the results file (it depends on
    torch's random number generators)."""
    x_train, y_train, x_test, y_test = load_shapes()
    digest = hashlib.sha256()
    for t in (x_train, y_train, x_test, y_test):
        digest.update(t.numpy().tobytes())
    return {"data": "load_shapes()", "torch": torch.__version__,
            "data_sha256": digest.hexdigest()[:16]}
