"""What ``hemiola advise`` measures of a model on one machine, kept as JSON so
that a profile measured once predicts any cluster (``--profile FILE``).

Every time is in seconds, every size in bytes. A profile can also be written
by hand (a published model's per-layer times and sizes): only ``forward``,
``backward``, ``step`` and ``params`` are required; the rest defaults to
"nothing measured" (no coding cost, no contention, no overhead).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

#: bump when a field changes meaning; a profile of another version is refused
#: (version 1 is read: its priority plan was in backward order, see from_json)
VERSION = 2
#: priority's default: the buckets holding the front layers' first quarter of
#: the bytes are issued front first (Config.priority_front_fraction)
FRONT_FRACTION = 0.25

# What a profile may say. A file beyond these bounds is corrupt, or describes
# no machine this advice is for: it is refused, naming the field, rather than
# predicted from (an infinite time never ends the model's simulation; an
# absurd one gives confident advice).
#: the largest profile file read (a measured one of a model with a thousand
#: parameter tensors is about 150 KiB)
MAX_FILE_BYTES = 16 << 20
#: any time in a profile, in seconds (one iteration's forward, a coding's
#: CPU per iteration, a parameter's read or gradient within one): an hour
MAX_SECONDS = 3600.0
#: any bandwidth, bytes per second (8 Pbit/s)
MAX_BANDWIDTH = 1e15
#: the slowest link a profile may have measured, bytes per second (8 kbit/s)
MIN_BANDWIDTH = 1e3
#: seconds per message on the link
MAX_LATENCY = 1.0
#: CPU seconds per byte sent (a millisecond: a kilobyte per second)
MAX_WIRE_CPU_PER_BYTE = 1e-3
#: a synchronous step over the slowest rank's own
MAX_LOCKSTEP = 1000.0
#: parameter tensors (a model with the most, a mixture of experts, has tens
#: of thousands; the prediction takes about 0.3 ms each), buckets in a plan,
#: elements in one tensor, bytes per element, bytes in all
MAX_PARAMS = 100_000
MAX_BUCKETS = 100_000
MAX_NUMEL = 1 << 48
MAX_ELEMENT_SIZE = 16
MAX_MODEL_BYTES = 1 << 50
#: ranks
MAX_WORLD = 1 << 24
#: the devices a profile may be measured on (``meta["device"]``)
DEVICES = ("cpu", "cuda")
#: what to do about a profile refused
REMEDY = ("measure it again (hemiola advise --save-profile FILE, without --profile) or "
          "correct it")


@dataclass
class Param:
    """One trainable parameter, in registration order."""

    numel: int
    element_size: int = 4
    #: first dimension of a matrix (PowerSGD's view), 0 for a vector
    rows: int = 0
    #: when the forward first reads it, from the forward's start
    need: float = 0.0
    #: when backward has produced its gradient, from the backward's start
    ready: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass
class Link:
    """The network the profile was measured on, as the collective model sees
    it (see :mod:`hemiola.advise.collective`)."""

    world: int
    #: seconds per message (the alpha term)
    latency: float
    #: bytes per second each rank sends and receives (the 1/beta term)
    bandwidth: float


@dataclass
class Profile:
    """One model on one machine (rank 0's medians; the ranks agree on them)."""

    forward: float
    backward: float
    #: the optimizer step of the bare model
    step: float
    params: list[Param]
    #: buckets (parameter indices) in issue order, per schedule; a parameter
    #: cut into pieces is in several; a schedule missing here uses DDP's
    #: plan, computed from the sizes
    plans: dict[str, list[list[int]]] = field(default_factory=dict)
    #: CPU seconds per iteration of each coding on the engine's thread for the
    #: whole model (copies in and out, coding, decoding), measured with a free
    #: wire (one rank)
    coding_cpu: dict[str, float] = field(default_factory=dict)
    #: how much a second of the engine's CPU work beside the computation
    #: delays it: 0 where they run on separate cores (a GPU's computation),
    #: 1 where they share one core
    contention: float = 0.0
    #: CPU seconds the engine spends per byte it sends (Gloo's copies and
    #: sums, the kernel's sockets)
    wire_cpu_per_byte: float = 0.0
    #: bytes per second a rank's collectives send at most while the
    #: computation runs beside them (on CPU ranks the collective's threads and
    #: sockets share the cores with it): the link's bandwidth times one
    #: all-reduce of every gradient alone over the same while each rank
    #: trains; 0 where it was not slower beside, or not measured
    wire_rate_beside: float = 0.0
    #: a synchronous job's step over the slowest rank's own (>= 1): where the
    #: ranks' step times vary independently, a job whose ranks meet every
    #: step waits each time for whichever is slowest then. forward, backward
    #: and step are the job's; ``streaming``'s ranks meet every H steps and
    #: go at ``free_compute``
    lockstep: float = 1.0
    #: per configuration ("wfbp+fp16"): the measured wrapped step on a free
    #: wire minus the model's prediction of it (hooks, Python, landings)
    overhead: dict[str, float] = field(default_factory=dict)
    #: the link the profile was measured on (None: measured without one)
    link: Link | None = None
    #: per coding: one all-reduce of every gradient measured on `link`
    reduce: dict[str, float] = field(default_factory=dict)
    #: per coding: what `reduce` takes beyond the model of it (the coding's
    #: CPU and its collectives on `link`), at least 0: the ranks waiting for
    #: each other. Each collective waits for every rank to have coded its
    #: part, so a coding of several rounds a bucket (PowerSGD's three, int8's
    #: two) waits that often for whichever rank is slower then, and Gloo's
    #: waiting threads spin on the CPU. Seconds per iteration for the whole
    #: model (its DDP plan's collectives), spent on the engine's lane like the
    #: coding's CPU, an equal part per collective; measured at `link`'s world
    #: (profiles written before the name changed call it ``meeting``)
    peer_wait: dict[str, float] = field(default_factory=dict)
    #: the optimizer's class name (Adam and AdamW turn decoupled's preview on)
    optimizer: str = "SGD"
    #: provenance: date, host, cpus, torch, hemiola, model, ...; ``device``
    #: (cpu or cuda); ``refused``: schedule: why it refused the model when
    #: measured (it is not predicted)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def compute(self) -> float:
        """One iteration's computation alone."""
        return self.forward + self.backward + self.step

    @property
    def free_compute(self) -> float:
        """One iteration's computation where the ranks do not meet each step
        (the slowest rank's own pace)."""
        return self.compute / self.lockstep

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def scaled(self, factor: float) -> Profile:
        """This profile on a machine whose CPU work takes `factor` times as
        long: every time but the link's. The wire's rate beside the
        computation stays as measured too: the ranks measure it together,
        the slowest included (``agree``); under ``--rescale-compute`` it is
        the rate of the machine the profile was measured on."""
        return replace(self.computation_scaled(factor),
                       coding_cpu={k: v * factor for k, v in self.coding_cpu.items()},
                       peer_wait={k: v * factor for k, v in self.peer_wait.items()},
                       overhead={k: v * factor for k, v in self.overhead.items()},
                       wire_cpu_per_byte=self.wire_cpu_per_byte * factor)

    def computation_scaled(self, factor: float) -> Profile:
        """This profile with only the computation (forward, backward, step
        and the times within them) `factor` times as long."""
        params = [Param(p.numel, p.element_size, p.rows, p.need * factor, p.ready * factor)
                  for p in self.params]
        return replace(self, forward=self.forward * factor, backward=self.backward * factor,
                       step=self.step * factor, params=params)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, **asdict(self)}

    def save(self, path: Path) -> None:
        """Writes the profile to `path` as JSON, atomically (a temporary file
        beside it, then renamed over it: an error leaves `path` as it was).
        Refused (ValueError naming `path` and why): a profile that
        :meth:`check` refuses (a NaN saved would be refused on reading it
        back), a symbolic link, a directory or a device, an error writing."""
        where = f"not saving the profile to {path}"
        self.check(where)
        try:
            text = json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:  # meta holding a NaN or an object
            raise ValueError(f"{where}: its meta is not plain JSON ({e})") from e
        write_atomically(path, text, "the profile")

    @classmethod
    def from_json(cls, data: Any, where: str = "profile") -> Profile:
        """The profile `data` (parsed JSON) holds; ValueError, beginning with
        `where`, naming the first field that is missing, of the wrong type or
        out of bounds (see :meth:`check`)."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: not a hemiola advise profile: it is a JSON "
                             f"{_json_kind(data)}, not an object with forward, backward, "
                             "step and params")
        data = dict(data)
        version = data.pop("version", VERSION)
        if "meeting" in data:  # peer_wait's name in profiles written before 2026-11-29
            if "peer_wait" in data:
                raise ValueError(f"{where}: both peer_wait and meeting (its old name) are given")
            data["peer_wait"] = data.pop("meeting")
        if isinstance(version, bool) or version not in (1, VERSION):
            raise ValueError(f"{where}: this profile is of version {_show(version)}; this "
                             f"hemiola reads version {VERSION}: measure it again with hemiola "
                             "advise --save-profile")
        raw_params = data.pop("params", None)
        if not isinstance(raw_params, list) or not all(isinstance(p, dict) for p in raw_params):
            raise ValueError(f"{where}: not a hemiola advise profile (params is "
                             f"{_show(raw_params)}): it needs forward, backward, step (seconds) "
                             "and params (a list of {numel, need, ready, ...})")
        if len(raw_params) > MAX_PARAMS:
            raise ValueError(f"{where}: params holds {len(raw_params)} parameters, more than "
                             f"the {MAX_PARAMS} read")
        link = data.pop("link", None)
        if link is not None and not isinstance(link, dict):
            raise ValueError(f"{where}: link is {_show(link)}, not an object "
                             "{world, latency, bandwidth} or null")
        try:
            params = [Param(**p) for p in raw_params]
            profile = cls(params=params, link=None if link is None else Link(**link), **data)
        except TypeError as e:
            raise ValueError(f"{where}: not a hemiola advise profile ({e}): it needs forward, "
                             "backward, step (seconds) and params (a list of {numel, need, "
                             "ready, ...})") from e
        profile.check(where)
        if version == 1 and "priority" in profile.plans:
            # version 1 read priority's buckets in backward order, not the
            # order the engine sends them in, which follows from it
            profile.plans["priority"] = front_first(params, profile.plans["priority"])
        return profile

    @classmethod
    def load(cls, path: Path) -> Profile:
        """The profile in the file `path`: ValueError naming the file, and
        the field and its value where one is refused (see :meth:`check`),
        for a file that is not a regular file, is larger than
        MAX_FILE_BYTES, is not JSON, or is not a profile this advice can
        trust. It reads at most MAX_FILE_BYTES + 1 bytes and never waits
        for a writer (a FIFO, a device)."""
        where = f"the profile {path}"
        text = read_bounded(path, MAX_FILE_BYTES, where)
        try:
            data = json.loads(text)
        except RecursionError as e:
            raise ValueError(f"{where} is not a profile: its JSON is nested too deeply; "
                             f"{REMEDY}") from e
        except ValueError as e:  # JSONDecodeError, an integer of too many digits
            raise ValueError(f"{where} is not JSON ({e}); {REMEDY}") from e
        try:
            return cls.from_json(data, where)
        except ValueError as e:
            message = str(e)
            if "--save-profile" in message:
                raise
            raise ValueError(f"{message}; {REMEDY}") from e

    def check(self, where: str = "profile") -> None:
        """Raises ValueError, beginning with `where`, naming the first field
        of the wrong type or out of its bounds, and its value: every number
        finite; times from 0 to MAX_SECONDS (``overhead``, a difference of
        two, from -MAX_SECONDS); ``contention`` from 0 to 1; ``lockstep``
        from 1 to MAX_LOCKSTEP; the sizes, link and plans whole and in
        range."""
        def number(name: str, value: Any, low: float, high: float, unit: str,
                   integer: bool = False) -> None:
            _bounded(where, name, value, low, high, unit, integer)

        for name in ("forward", "backward", "step"):
            number(name, getattr(self, name), 0.0, MAX_SECONDS, "seconds")
        if self.compute <= 0:
            raise ValueError(f"{where}: forward, backward and step are all 0: one iteration's "
                             "computation must take some time")
        number("contention", self.contention, 0.0, 1.0, "(delay per second of CPU work beside)")
        number("wire_cpu_per_byte", self.wire_cpu_per_byte, 0.0, MAX_WIRE_CPU_PER_BYTE,
               "seconds per byte")
        number("wire_rate_beside", self.wire_rate_beside, 0.0, MAX_BANDWIDTH, "bytes per second")
        number("lockstep", self.lockstep, 1.0, MAX_LOCKSTEP, "(the job's step over a rank's)")
        if not isinstance(self.params, list):
            raise ValueError(f"{where}: params is {_show(self.params)}, not a list")
        if not self.params:
            raise ValueError(f"{where}: params is empty (a model without trainable parameters "
                             "has nothing to reduce)")
        if len(self.params) > MAX_PARAMS:
            raise ValueError(f"{where}: params holds {len(self.params)} parameters, more than "
                             f"the {MAX_PARAMS} read")
        for i, p in enumerate(self.params):
            number(f"params[{i}].numel", p.numel, 1, MAX_NUMEL, "elements", integer=True)
            number(f"params[{i}].element_size", p.element_size, 1, MAX_ELEMENT_SIZE, "bytes",
                   integer=True)
            number(f"params[{i}].rows", p.rows, 0, p.numel, "(at most its numel)", integer=True)
            number(f"params[{i}].need", p.need, 0.0, MAX_SECONDS, "seconds")
            number(f"params[{i}].ready", p.ready, 0.0, MAX_SECONDS, "seconds")
        if self.nbytes > MAX_MODEL_BYTES:
            raise ValueError(f"{where}: params hold {self.nbytes} bytes in all, more than "
                             f"{MAX_MODEL_BYTES} (1 PiB)")
        if not isinstance(self.plans, dict):
            raise ValueError(f"{where}: plans is {_show(self.plans)}, not an object of "
                             "schedule: buckets")
        for schedule, plan in self.plans.items():
            if not isinstance(plan, list) or not all(
                    isinstance(bucket, list) and bucket
                    and all(isinstance(i, int) and not isinstance(i, bool) for i in bucket)
                    for bucket in plan):
                raise ValueError(f"{where}: plans[{schedule!r}] is {_show(plan)}: it must be "
                                 "a list of buckets, each a non-empty list of parameter "
                                 "indices")
            # each bucket after the first cuts at most one parameter in two
            entries = sum(len(bucket) for bucket in plan)
            if len(plan) > MAX_BUCKETS or entries > len(self.params) + len(plan) or any(
                    len(set(bucket)) < len(bucket) for bucket in plan):
                raise ValueError(f"{where}: plans[{schedule!r}] holds {len(plan)} buckets of "
                                 f"{entries} pieces for {len(self.params)} parameters: at most "
                                 f"{MAX_BUCKETS} buckets, a parameter at most once in each, "
                                 "and pieces no more than parameters plus buckets")
            seen = sorted({i for bucket in plan for i in bucket})
            if seen != list(range(len(self.params))):
                raise ValueError(f"{where}: the {schedule} plan must hold every parameter "
                                 f"index 0..{len(self.params) - 1} and no other")
        for name, low in (("coding_cpu", 0.0), ("peer_wait", 0.0), ("reduce", 0.0),
                          ("overhead", -MAX_SECONDS)):
            values = getattr(self, name)
            if not isinstance(values, dict):
                raise ValueError(f"{where}: {name} is {_show(values)}, not an object of "
                                 "name: seconds")
            for key, seconds in values.items():
                number(f"{name}[{key!r}]", seconds, low, MAX_SECONDS, "seconds")
        if self.link is not None:
            number("link.world", self.link.world, 1, MAX_WORLD, "ranks", integer=True)
            number("link.latency", self.link.latency, 0.0, MAX_LATENCY, "seconds")
            number("link.bandwidth", self.link.bandwidth, MIN_BANDWIDTH, MAX_BANDWIDTH,
                   "bytes per second")
        if not isinstance(self.optimizer, str):
            raise ValueError(f"{where}: optimizer is {_show(self.optimizer)}, not a class name")
        if not isinstance(self.meta, dict):
            raise ValueError(f"{where}: meta is {_show(self.meta)}, not an object")
        device = self.meta.get("device", "cpu")
        if device not in DEVICES:
            raise ValueError(f"{where}: meta['device'] is {_show(device)}, not one of "
                             f"{', '.join(DEVICES)}")
        for key in ("slowest_rank", "rescaled"):
            if key in self.meta:
                number(f"meta[{key!r}]", self.meta[key], 0.0, MAX_LOCKSTEP, "(a ratio)")
        refused = self.meta.get("refused", {})
        if not isinstance(refused, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in refused.items()):
            raise ValueError(f"{where}: meta['refused'] is {_show(refused)}, not an object of "
                             "schedule: why it refused the model")


def _json_kind(value: Any) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _show(value: Any, limit: int = 60) -> str:
    """`value` for a message: its repr, cut short."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else \
        f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def number_text(value: float) -> str:
    """A bound for a message: 16777216, 3600, 0.001, 1e+15."""
    if isinstance(value, int) or (value.is_integer() and abs(value) < 1e7):
        return str(int(value))
    return f"{value:g}"


def _bounded(where: str, name: str, value: Any, low: float, high: float, unit: str,
             integer: bool = False) -> None:
    """ValueError unless `value` is a finite number (an integer where
    `integer`) from `low` to `high`; the message names `name`, `value` and
    the bounds."""
    kind = "an integer" if integer else "a finite number"
    must = f"it must be {kind} from {number_text(low)} to {number_text(high)} {unit}".rstrip()
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (integer and not isinstance(value, int)):
        raise ValueError(f"{where}: {name} is {_show(value)}, not {kind}: {must}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {name} is {_show(value)}: {must}")
    if value < 0 <= low:
        raise ValueError(f"{where}: {name} is negative ({_show(value)}): {must}")
    if not low <= value <= high:
        raise ValueError(f"{where}: {name} is {_show(value)}: {must}")


def read_bounded(path: Path, limit: int, what: str) -> str:
    """The text of the regular file `path`, at most `limit` bytes: else
    ValueError saying `what` and why. Never blocks on a FIFO without a
    writer nor reads an endless device: anything not a regular file is
    refused before it is read, and at most `limit` + 1 bytes are read."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ValueError(f"cannot read {what}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"cannot read {what}: it is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"cannot read {what}: it is not a regular file (a device, FIFO "
                             "or socket, read without end or waiting for a writer): copy it "
                             "into a file")
        if st.st_size > limit:
            raise ValueError(f"cannot read {what}: it holds {st.st_size} bytes, more than the "
                             f"{limit} a profile may (a measured one is well under 1 MiB)")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise ValueError(f"cannot read {what}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"cannot read {what}: it holds more than the {limit} bytes a profile "
                         "may (it grew while read)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not a profile: not UTF-8 text (byte {e.start}); "
                         f"{REMEDY}") from e


def write_atomically(path: Path, text: str, what: str) -> None:
    """Writes `text` to `path` through a temporary file beside it, renamed
    over `path` once written and synced: `path` is either as it was or
    whole. Refused, ValueError naming `path` (nothing written there): a
    symbolic link (never written through), a directory, anything not a
    regular file (a device, a FIFO), an error while writing (a full disk);
    the temporary file is removed."""
    check_writable(path, what)
    name = f".{path.name[:100]}.{secrets.token_hex(4)}.tmp"
    tmp = path.parent / name
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(tmp, flags, 0o666)  # the umask's mode, as a new file gets
    except OSError as e:
        raise ValueError(f"cannot write {what} to {path}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            with contextlib.suppress(FileNotFoundError):  # keep a file's mode
                os.fchmod(fd, stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode))
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise ValueError(f"cannot write {what} to {path}: {e.strerror or e}; nothing "
                             "was written there") from e
        raise


def check_writable(path: Path, what: str) -> None:
    """ValueError naming `path` if :func:`write_atomically` would refuse it
    (a symbolic link, a directory, not a regular file); a missing folder is
    found when writing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ValueError(f"cannot write {what} to {path}: {e.strerror or e}") from e
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"not writing {what} to {path}: it is a symbolic link (to "
                         f"{os.readlink(path)}), not written through: give the file it "
                         "names, or another path")
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"cannot write {what} to {path}: it is a directory: give a file "
                         "name")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"not writing {what} to {path}: it is not a regular file (a "
                         "device, FIFO or socket): give a file name")


def cut_into(plan: Sequence[Sequence[int]]) -> dict[int, int]:
    """Per parameter index, how many buckets of `plan` hold a piece of it
    (the engine cuts a parameter larger than what a bucket has left)."""
    count: dict[int, int] = {}
    for bucket in plan:
        for i in bucket:
            count[i] = count.get(i, 0) + 1
    return count


def front_first(params: list[Param], plan: list[list[int]],
                fraction: float = FRONT_FRACTION) -> list[list[int]]:
    """`plan` (backward order) with the buckets that hold the first `fraction`
    of the bytes (the front layers) moved to the end, front first, and at
    least one bucket left in its place: priority's issue order, as the
    engine derives it (cpp/src/engine/updater/priority_policy.cpp; a
    parameter cut into pieces counts its share of the bytes in each bucket)."""
    count = cut_into(plan)
    sizes = [sum(params[i].nbytes / count[i] for i in bucket) for bucket in plan]
    tail: list[int] = []
    covered = 0.0
    for k in reversed(range(len(plan))):
        if covered >= fraction * sum(sizes) or len(tail) + 1 >= len(plan):
            break
        tail.append(k)
        covered += sizes[k]
    return plan[: len(plan) - len(tail)] + [plan[k] for k in tail]
