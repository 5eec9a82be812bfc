"""``hemiola advise --profile FILE`` does not trust its file (issue 57, item
14): a NaN or an infinity in any time (which never ended the model's
simulation), a negative or absurd value (which gave confident advice), the
wrong JSON or types, a huge or endless file, ``--latency-us inf`` and the
like are refused within a second and a bounded amount of memory, with one
line naming the file (or option), the field and the value; ``--save-profile``
never writes through a symbolic link, into a directory or a device, leaves
no half-written file, and never saves what it would refuse to read."""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hemiola.advise import model
from hemiola.advise import profile as profile_module
from hemiola.advise.collective import Network
from hemiola.advise.profile import MAX_FILE_BYTES, Link, Param, Profile
from hemiola.advise.simulation import Job, Segment, simulate
from hemiola.cli import build_parser
from hemiola.cli import main as hemiola_main

#: a refusal takes well under this (the old code looped forever on a NaN)
QUICK_S = 1.0
#: the guard around each call: past it the call is interrupted and fails
GUARD_S = 10.0
NAN, INF = float("nan"), float("inf")
REMEDY = "measure it again (hemiola advise --save-profile FILE, without --profile)"


def _valid() -> dict[str, Any]:
    """A profile with every kind of field, as a measured one holds."""
    params = [{"numel": 589824, "element_size": 4, "rows": 768, "need": 0.0, "ready": 0.028},
              {"numel": 768, "element_size": 4, "rows": 0, "need": 0.0, "ready": 0.027},
              {"numel": 7680, "element_size": 4, "rows": 10, "need": 0.01, "ready": 0.001}]
    codings = {"none": 0.002, "fp16": 0.007, "int8": 0.012, "powersgd": 0.012}
    return {"version": 2, "forward": 0.014, "backward": 0.028, "step": 0.0045,
            "params": params, "plans": {"wfbp": [[2, 1], [0]], "priority": [[2], [1], [0]]},
            "coding_cpu": {**codings, "int4": 0.016}, "contention": 1.0,
            "wire_cpu_per_byte": 2.4e-9, "wire_rate_beside": 1.7e7, "lockstep": 1.05,
            "overhead": {"wfbp+none": 0.0013, "priority+int8": -0.003, "streaming-sync": 0.008},
            "link": {"world": 2, "latency": 1e-5, "bandwidth": 1.8e7},
            "reduce": {k: 0.1 for k in codings}, "peer_wait": {"none": 0.01, "int8": 0.0},
            "optimizer": "SGD", "meta": {"device": "cpu", "slowest_rank": 1.05}}


@contextmanager
def _quick() -> Iterator[None]:
    """Fails the call within if it takes more than QUICK_S; interrupts it
    (an endless loop in Python) after GUARD_S."""
    def fire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {GUARD_S} s: a hang")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, GUARD_S)
    start = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - start < QUICK_S


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """The command's modules imported before any call is timed."""
    build_parser()


def _advise(*args: str) -> int:
    """``hemiola advise ARGS`` (predicting 64 ranks) in this process."""
    return hemiola_main(["advise", "--world", "64", *args])


def _refusal(*args: str) -> str:
    """The one-line message ``hemiola advise ARGS`` ends with, quickly."""
    with _quick(), pytest.raises(SystemExit) as e:
        _advise(*args)
    message = str(e.value.code)
    assert message.startswith("hemiola advise: ") and "\n" not in message, message
    return message


def _write(tmp_path: Path, data: Any, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _with(change: str, value: Any) -> dict[str, Any]:
    """The valid profile with the field at dotted path `change` set to `value`."""
    data = _valid()
    *outer, last = change.split(".")
    at: Any = data
    for key in outer:
        at = at[int(key)] if isinstance(at, list) else at[key]
    at[int(last) if isinstance(at, list) else last] = value
    return data


def test_the_valid_profile_predicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _valid())
    with _quick():
        assert _advise("--profile", str(path), "--rate", "10") == 0
    assert "Use: hemiola.wrap(" in capsys.readouterr().out
    with _quick():
        assert _advise("--profile", str(path)) == 0  # at the profile's own link


# Every kind of number a profile holds: the times of the computation, the
# contention, a coding's cost, the ranks' wait, an overhead, the link, a
# parameter's read and gradient. An infinity here used to loop forever at
# 100% CPU (forward, backward, step, contention, coding_cpu, peer_wait,
# wire_cpu_per_byte), a NaN too (coding_cpu, peer_wait), or predict nonsense
# with exit status 0 (overhead, need, ready, lockstep, the link).
FIELDS = ["forward", "backward", "step", "contention", "wire_cpu_per_byte",
          "wire_rate_beside", "lockstep", "coding_cpu.int8", "peer_wait.none",
          "overhead.wfbp+none", "reduce.int8", "params.0.need", "params.2.ready",
          "link.latency", "link.bandwidth"]


def _shown(field: str) -> str:
    """How a message names the field at a dotted path."""
    head, *rest = field.split(".")
    if head == "params":
        return f"params[{rest[0]}].{rest[1]}"
    if head == "link":
        return field
    return f"{head}[{rest[0]!r}]" if rest else head


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("field", FIELDS)
def test_a_non_finite_number_is_refused(tmp_path: Path, field: str, value: float) -> None:
    path = _write(tmp_path, _with(field, value))
    message = _refusal("--profile", str(path), "--rate", "10")
    assert f"the profile {path}: {_shown(field)} is {value!r}" in message
    assert "it must be a finite number from" in message and REMEDY in message


def test_an_overflowing_literal_is_refused_as_inf(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps(_valid()).replace('"forward": 0.014', '"forward": 1e999'))
    message = _refusal("--profile", str(path), "--rate", "10")
    assert "forward is inf: it must be a finite number from 0 to 3600 seconds" in message


ABSURD = [
    ("forward", -1, "forward is negative (-1): it must be a finite number from 0 to 3600 "
                    "seconds"),
    ("forward", 1e300, "forward is 1e+300: it must be a finite number from 0 to 3600 seconds"),
    ("step", 86400.0, "step is 86400.0: it must be a finite number from 0 to 3600 seconds"),
    ("contention", 5.0, "contention is 5.0: it must be a finite number from 0 to 1"),
    ("lockstep", 0.5, "lockstep is 0.5: it must be a finite number from 1 to 1000"),
    ("coding_cpu.int8", -0.1, "coding_cpu['int8'] is negative (-0.1)"),
    ("overhead.wfbp+none", -1e9, "overhead['wfbp+none'] is -1000000000.0: it must be a "
                                 "finite number from -3600 to 3600 seconds"),
    ("wire_cpu_per_byte", 1.0, "wire_cpu_per_byte is 1.0: it must be a finite number from "
                               "0 to 0.001 seconds per byte"),
    ("link.bandwidth", 0, "link.bandwidth is 0: it must be a finite number from 1000 to "
                          "1e+15 bytes per second"),
    ("link.world", 0, "link.world is 0: it must be an integer from 1 to 16777216 ranks"),
    ("params.0.numel", 10**30, "params[0].numel is 1000000000000000000000000000000: it must "
                               "be an integer from 1 to 281474976710656 elements"),
    ("params.0.numel", 10**4000, "params[0].numel is an integer of 13288 bits"),
    ("params.0.numel", 1.5, "params[0].numel is 1.5, not an integer"),
    ("params.0.element_size", 0, "params[0].element_size is 0: it must be an integer from 1 "
                                 "to 16 bytes"),
    ("params.2.rows", 10**6, "params[2].rows is 1000000: it must be an integer from 0 to 7680"),
    ("forward", "0.01", "forward is '0.01', not a finite number"),
    ("forward", True, "forward is True, not a finite number"),
    ("forward", None, "forward is None, not a finite number"),
    ("coding_cpu", [1], "coding_cpu is [1], not an object of name: seconds"),
    ("plans", "x", "plans is 'x', not an object of schedule: buckets"),
    ("plans.wfbp", [[0, 1, 2], []], "plans['wfbp'] is [[0, 1, 2], []]: it must be a list of "
                                    "buckets, each a non-empty list"),
    ("plans.wfbp", [[0, 1, 2]] + [[0]] * 100000, "plans['wfbp'] holds 100001 buckets"),
    ("plans.wfbp", [[0, 1, 2, 2]], "a parameter at most once in each"),
    ("meta", [], "meta is [], not an object"),
    ("meta.device", "tpu", "meta['device'] is 'tpu', not one of cpu, cuda"),
    ("meta.slowest_rank", "fast", "meta['slowest_rank'] is 'fast', not a finite number"),
    ("optimizer", 3, "optimizer is 3, not a class name"),
    ("params", {"a": 1}, "not a hemiola advise profile (params is {'a': 1})"),
    ("params", [], "params is empty"),
    ("link", "fast", "link is 'fast', not an object"),
    ("version", "2", "this profile is of version '2'"),
]


@pytest.mark.parametrize(("field", "value", "words"), ABSURD,
                         ids=[f"{field}-{k}" for k, (field, _, _) in enumerate(ABSURD)])
def test_a_wrong_or_absurd_value_is_refused(tmp_path: Path, field: str, value: Any,
                                            words: str) -> None:
    path = _write(tmp_path, _with(field, value))
    message = _refusal("--profile", str(path), "--rate", "10")
    assert f"the profile {path}: " in message and words in message
    assert "--save-profile" in message


def test_the_computation_must_take_some_time(tmp_path: Path) -> None:
    data = {**_valid(), "forward": 0, "backward": 0, "step": 0.0}
    message = _refusal("--profile", str(_write(tmp_path, data)), "--rate", "10")
    assert "forward, backward and step are all 0" in message


WRONG_JSON = [
    ("[1, 2]", "not a hemiola advise profile: it is a JSON array, not an object"),
    ('"forward"', "it is a JSON string"),
    ("", "is not JSON (Expecting value"),
    ('{"forward": 0.01,', "is not JSON"),
    ("[" * 100000 + "]" * 100000, "its JSON is nested too deeply"),
    ('{"forward": 1' + "0" * 5000 + "}", "is not JSON (Exceeds the limit"),
    ('{"forward": 1}', "not a hemiola advise profile (params is None)"),
    ('{"forward": 1, "backward": 1, "step": 1, "params": [{"numel": 1}], "colour": 1}',
     "unexpected keyword argument 'colour'"),
]


@pytest.mark.parametrize(("text", "words"), WRONG_JSON,
                         ids=["array", "string", "empty", "cut", "deep", "digits", "no-params",
                              "unknown-field"])
def test_wrong_json_is_refused(tmp_path: Path, text: str, words: str) -> None:
    path = _write(tmp_path, text)
    message = _refusal("--profile", str(path), "--rate", "10")
    assert f"the profile {path}" in message and words in message


def test_a_file_not_of_text_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b"\xff\xfe{}")
    assert "is not a profile: not UTF-8 text (byte 0)" in _refusal("--profile", str(path))


def test_a_directory_or_a_missing_file_is_refused(tmp_path: Path) -> None:
    assert _refusal("--profile", str(tmp_path)).endswith(
        f"cannot read the profile {tmp_path}: it is a directory")
    assert _refusal("--profile", str(tmp_path / "none.json")).endswith(
        f"cannot read the profile {tmp_path / 'none.json'}: No such file or directory")


def test_a_huge_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A sparse file of twice the bound: refused on its size, reading
    nothing (the old code read all of it, a 1 GB file in 5 s and 2.3 GB)."""
    path = tmp_path / "huge.json"
    with path.open("wb") as f:
        f.truncate(2 * MAX_FILE_BYTES)
    tracemalloc.start()
    try:
        with _quick(), pytest.raises(ValueError) as e:
            Profile.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(e.value) == (f"cannot read the profile {path}: it holds {2 * MAX_FILE_BYTES} "
                            f"bytes, more than the {MAX_FILE_BYTES} a profile may (a measured "
                            "one is well under 1 MiB)")
    assert peak < 1 << 20


def test_a_file_whose_size_says_little_is_read_no_further_than_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose size says nothing (/proc's say 0) or that grows while
    read: at most the bound and one byte are read."""
    with pytest.raises(ValueError, match="holds more than the 100 bytes a profile may"):
        profile_module.read_bounded(Path("/proc/self/maps"), 100, "the profile")
    path = _write(tmp_path, " " * 5000)
    monkeypatch.setattr(profile_module, "MAX_FILE_BYTES", 1000)
    with pytest.raises(ValueError, match="it holds 5000 bytes, more than the 1000"):
        Profile.load(path)


def _run_limited(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """``hemiola advise ARGS`` in a process of at most 2 GiB of data, within
    `timeout` seconds (the command itself imports torch: about 2 s)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))

    return subprocess.run([sys.executable, "-m", "hemiola", "advise", "--world", "64",
                           "--rate", "10", *args], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit)


def test_an_endless_file_is_refused(tmp_path: Path) -> None:
    """/dev/zero never ends (the old code read it until memory ran out, 4.5
    GB in 5 s); a FIFO without a writer never opens (the old code waited
    forever): neither is a regular file, refused before reading."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        start = time.perf_counter()
        r = _run_limited("--profile", path)
        assert time.perf_counter() - start < 15
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr == (f"hemiola advise: cannot read the profile {path}: it is not a "
                            "regular file (a device, FIFO or socket, read without end or "
                            "waiting for a writer): copy it into a file\n")


def test_a_nan_ends_the_command_quickly_with_one_line(tmp_path: Path) -> None:
    """The whole command: it used to spin at 100% CPU until killed."""
    path = _write(tmp_path, _with("coding_cpu.int8", NAN))
    r = _run_limited("--profile", str(path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"hemiola advise: the profile {path}: coding_cpu['int8'] is nan")
    assert r.stderr.count("\n") == 1


OPTIONS = [
    ("--latency-us", "inf", "'inf' is out of range: it must be a finite number from 0 to "
                            "1000000 microseconds"),
    ("--latency-us", "nan", "'nan' is out of range"),
    ("--latency-us", "-5", "'-5' is out of range"),
    ("--latency-us", "1e300", "'1e300' is out of range"),
    ("--latency-us", "fast", "'fast' is not a number"),
    ("--rate", "inf", "'inf' is out of range: it must be a finite number from 1e-06 to "
                      "1000000 Gbit/s"),
    ("--rate", "0", "'0' is out of range"),
    ("--rate", "1e-300", "'1e-300' is out of range"),
    ("--intra-rate", "nan", "'nan' is out of range"),
    ("--world", "100000000000", "'100000000000' is out of range: it must be an integer from "
                                "1 to 16777216 ranks"),
    ("--world", "0", "'0' is out of range"),
    ("--gpus-per-node", "-8", "'-8' is out of range"),
    ("--sharing", "1000000000000", "'1000000000000' is out of range"),
    ("--rounds", "0", "'0' is out of range"),
    ("--iterations", "-1", "'-1' is out of range"),
    ("--repeats", "1.5", "'1.5' is not a number: it must be an integer"),
]


@pytest.mark.parametrize(("option", "value", "words"), OPTIONS,
                         ids=[f"{option}={value}" for option, value, _ in OPTIONS])
def test_an_option_out_of_range_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           option: str, value: str, words: str) -> None:
    """Refused while parsing, naming the option (``--latency-us inf`` used to
    loop forever; ``--rate inf`` and ``--sharing 1e12`` predicted nonsense)."""
    path = _write(tmp_path, _valid())
    with _quick(), pytest.raises(SystemExit) as e:
        hemiola_main(["advise", "--profile", str(path), "--world", "64", "--rate", "10",
                      "--gpus-per-node", "8", f"{option}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"hemiola advise: error: argument {option}: {words}" in err
    assert "Traceback" not in err


def test_no_network_of_infinite_or_nan_numbers() -> None:
    for kw in ({"bandwidth": INF}, {"bandwidth": NAN}, {"latency": INF}, {"latency": NAN},
               {"intra_bandwidth": INF}):
        with pytest.raises(ValueError, match="must be"):
            Network(**{"world": 64, "bandwidth": 1e9, **kw})


def test_the_simulation_ends_whatever_it_is_given() -> None:
    """Defence in depth, behind the profile's checks: a profile built in
    code (not loaded) with an infinite time, and the simulation itself
    given one, end with a ValueError, never a loop."""
    profile = Profile(forward=0.01, backward=0.02, step=0.005,
                      params=[Param(1000, need=0.0, ready=0.02), Param(3000, ready=0.01)],
                      coding_cpu={"int8": INF}, link=Link(2, 1e-5, 1e8))
    net = Network(64, 1e9)
    with _quick():
        with pytest.raises(ValueError, match="cannot simulate a bucket.s reduction of inf"):
            model.predict_one(profile, net, "wfbp", "int8")
        with pytest.raises(ValueError, match="predicts inf seconds per iteration"):
            model.streaming_step(profile, net, 20, 1, 0, "int8")
        for program, jobs, contention in [([Segment(INF)], [Job(0.0, 0.01)], 0.0),
                                          ([Segment(0.01, (), (0,))], [Job(NAN, 0.01)], 0.0),
                                          ([Segment(0.01, (), (0,))], [Job(0.01, 0.01)], NAN)]:
            with pytest.raises(ValueError, match="cannot simulate"):
                simulate(program, jobs, contention)
    # a finite simulation still comes out as before
    assert simulate([Segment(0.01, (), (0,)), Segment(0.0, ((0, 0),))],
                    [Job(0.0, 0.02)], 0.0) == pytest.approx(0.03)


# --save-profile


def _saving(tmp_path: Path, target: Path) -> str:
    """``hemiola advise --profile (valid) --save-profile TARGET``'s refusal."""
    return _refusal("--profile", str(_write(tmp_path, _valid(), "in.json")), "--rate", "10",
                    "--save-profile", str(target))


def test_saving_writes_a_whole_file_that_reads_back(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    source = _write(tmp_path, _valid(), "in.json")
    target = tmp_path / "out.json"
    target.write_text("old")
    target.chmod(0o640)
    with _quick():
        assert _advise("--profile", str(source), "--rate", "10", "--save-profile",
                       str(target)) == 0
    assert f"profile written to {target}" in capsys.readouterr().out
    assert Profile.load(target) == Profile.load(source)
    assert target.stat().st_mode & 0o777 == 0o640  # the file's mode is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json", "out.json"]


def test_saving_never_writes_through_a_symbolic_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "p.json"
    link.symlink_to(victim)
    message = _saving(tmp_path, link)
    assert message == (f"hemiola advise: not writing the profile to {link}: it is a symbolic "
                       f"link (to {victim}), not written through: give the file it names, or "
                       "another path")
    assert victim.read_text() == "keep me" and link.is_symlink()
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere")
    assert "it is a symbolic link" in _saving(tmp_path, dangling)
    assert not (tmp_path / "nowhere").exists()


def test_saving_to_a_directory_or_a_device_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    assert _saving(tmp_path, folder) == (f"hemiola advise: cannot write the profile to "
                                         f"{folder}: it is a directory: give a file name")
    assert _saving(tmp_path, Path("/dev/full")) == (
        "hemiola advise: not writing the profile to /dev/full: it is not a regular file (a "
        "device, FIFO or socket): give a file name")
    missing = tmp_path / "no" / "p.json"
    assert _saving(tmp_path, missing) == (f"hemiola advise: cannot write the profile to "
                                          f"{missing}: No such file or directory")


def test_a_full_disk_leaves_the_old_file_whole(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A write error (the disk full, seen at the latest when the file is
    synced): one line naming the path; the file there is as it was, and no
    temporary file is left."""
    target = tmp_path / "out.json"
    target.write_text("the old profile")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(profile_module.os, "fsync", full)
    message = _saving(tmp_path, target)
    assert message == (f"hemiola advise: cannot write the profile to {target}: No space left "
                       "on device; nothing was written there")
    assert target.read_text() == "the old profile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json", "out.json"]


def test_what_would_be_refused_is_never_saved(tmp_path: Path) -> None:
    """A profile holding a NaN (measured, or built in code) used to be saved
    as NaN and then hang whoever loaded it; now saving refuses it, naming
    the field, and writes nothing."""
    good = Profile.from_json(_valid())
    target = tmp_path / "p.json"
    for bad, words in [(copy.deepcopy(good), "coding_cpu['int8'] is nan"),
                       (copy.deepcopy(good), "forward is inf"),
                       (copy.deepcopy(good), "its meta is not plain JSON")]:
        if "coding_cpu" in words:
            bad.coding_cpu["int8"] = NAN
        elif "forward" in words:
            bad.forward = INF
        else:
            bad.meta["load"] = NAN
        with _quick(), pytest.raises(ValueError) as e:
            bad.save(target)
        assert str(e.value).startswith(f"not saving the profile to {target}: ")
        assert words in str(e.value)
        assert not target.exists()
    good.save(target)
    assert "NaN" not in target.read_text() and Profile.load(target) == good
    assert math.isfinite(Profile.load(target).compute)


def test_the_save_target_is_checked_before_measuring(tmp_path: Path) -> None:
    """With --local N the profile is measured (minutes) before it is saved:
    a target that would be refused is refused first."""
    link = tmp_path / "p.json"
    link.symlink_to(tmp_path / "elsewhere")
    with _quick(), pytest.raises(SystemExit) as e:
        hemiola_main(["advise", "--local", "2", "--save-profile", str(link)])
    assert "it is a symbolic link" in str(e.value.code)
