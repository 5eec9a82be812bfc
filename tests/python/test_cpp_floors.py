"""The C++ floors, read from the build's own rules (``hemiola_floor(...)`` in
cpp/CMakeLists.txt): no file of cpp/src includes a floor above its own. The
build already refuses an upward include in a compiled file (each floor
compiles against a view of the floors below it); this also catches one in a
header that no file of its floor happens to include yet."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "cpp" / "src"

FLOOR = re.compile(r"^hemiola_floor\((\w+) DIR (\S+)(?: BELOW ([\w ]+?))?(?: ROOT)?\)$",
                   re.MULTILINE)
INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)


def _floors() -> dict[str, tuple[str, set[str]]]:
    """Floor name -> (its folder under cpp/src, the floors it may include)."""
    text = (ROOT / "cpp" / "CMakeLists.txt").read_text()
    return {m.group(1): (m.group(2), set((m.group(3) or "").split()))
            for m in FLOOR.finditer(text)}


def _floor_of(path: Path, folders: dict[str, str]) -> str | None:
    """The floor whose folder holds `path` (the deepest match), or None."""
    relative = path.relative_to(SRC).parent.as_posix()
    return folders.get(relative)


def test_the_floors_are_read_from_the_build() -> None:
    floors = _floors()
    assert {"core", "cuda", "comm", "codec", "reducer", "updater", "engine", "ps"} <= set(floors)
    assert floors["core"][1] == set()
    assert "codec" in floors["reducer"][1] and "reducer" not in floors["codec"][1]


def test_no_file_includes_a_floor_above_its_own() -> None:
    floors = _floors()
    folders = {folder: name for name, (folder, _) in floors.items()}
    offending = []
    checked = 0
    for path in sorted(SRC.rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh"):
            continue
        floor = _floor_of(path, folders)
        if floor is None or floor == "engine":  # the composition root sees everything
            continue
        allowed = {floors[floor][0]} | {floors[b][0] for b in floors[floor][1]}
        for included in INCLUDE.findall(path.read_text()):
            folder = included.rpartition("/")[0]
            if folder in folders and folder not in allowed:
                offending.append(f"{path.relative_to(SRC)} ({floor}) includes {included}")
            checked += 1
    assert checked > 100, "no includes found: is the parser wrong?"
    assert offending == []
