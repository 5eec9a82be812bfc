"""The job token of a parameter-server job: the secret a server asks of every
connection before it touches its state.

``HEMIOLA_JOB_TOKEN``, when set, is the token (the same on every rank). A job
on one machine without it (``torchrun --nproc-per-node N`` as documented) gets
one of its own: rank 0 writes a random token into a file that only its user
may read (``tempfile.mkstemp``: mode 0600) and publishes the file's *path* in
the job's store; every other rank reads the file. A stranger on the machine
reaches the store (it has no authentication) and learns the path, but cannot
read the file unless it runs as the job's user, who could read the ranks'
memory anyway. A job across machines cannot share a file, so it must be given
the token: it is refused without one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterator

from hemiola._native import C
from hemiola.ps.roles import JOB_TOKEN_ENV, Role

#: The key (under the hemiola.ps prefix) where rank 0 publishes the token
#: file's path; one per torchrun restart, so a restarted job never reads the
#: previous attempt's.
TOKEN_FILE_KEY = "job_token_file"


def loopback(address: str) -> bool:
    """Whether `address` names this machine's loopback interface."""
    return address in ("localhost", "::1") or address.startswith("127.")


def one_machine() -> bool:
    """Whether every rank of the job runs on this machine: torchrun's
    ``LOCAL_WORLD_SIZE`` equals ``WORLD_SIZE``, or the job's store is on
    loopback (``MASTER_ADDR``), which only this machine reaches."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    return (local is not None and local == world) or loopback(os.environ.get("MASTER_ADDR", ""))


@contextlib.contextmanager
def job_token(r: Role, store: C.Store, timeout_s: float) -> Iterator[str]:
    """The job's token, for as long as the block runs (rank 0 removes its
    token file when the block ends). Every rank of the job enters it."""
    token = os.environ.get(JOB_TOKEN_ENV, "")
    key = f"{TOKEN_FILE_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if token:
        if r.rank == 0:  # no file: a rank without the variable learns so at once
            store.set(key, b"")
        yield token
        return
    if not one_machine():
        raise RuntimeError(
            f"hemiola.ps: this job spans machines (WORLD_SIZE {os.environ.get('WORLD_SIZE')}, "
            f"LOCAL_WORLD_SIZE {os.environ.get('LOCAL_WORLD_SIZE')}, MASTER_ADDR "
            f"{os.environ.get('MASTER_ADDR')!r}) and {JOB_TOKEN_ENV} is not set, so anyone who "
            f"reaches a server could join it: set {JOB_TOKEN_ENV} to the same secret on every "
            "rank, e.g. export HEMIOLA_JOB_TOKEN=$(python -c 'import secrets; "
            "print(secrets.token_hex(16))') and copy it to every machine before torchrun")
    if r.rank != 0:
        try:
            path = store.get(key, timeout_s).decode()
        except TimeoutError as e:
            raise RuntimeError(f"hemiola.ps: rank 0 (server 0) did not publish the job token "
                               f"within {timeout_s} s: did it start? ({e})") from None
        if not path:
            raise RuntimeError(f"hemiola.ps: rank 0 was given {JOB_TOKEN_ENV}, rank {r.rank} "
                               "was not: set it to the same secret on every rank")
        yield _read_token_file(path)
        return
    token = secrets.token_hex(16)
    fd, path = tempfile.mkstemp(prefix="hemiola-job-token-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token)
        store.set(key, path.encode())
        yield token
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _read_token_file(path: str) -> str:
    """The token in rank 0's file, checked to be this user's own and private:
    a stranger who overwrote the published path cannot substitute a token."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise RuntimeError(
            f"hemiola.ps: the job token file {path} that rank 0 published is gone: rank 0 has "
            f"stopped (see its error), or runs on another machine (then set {JOB_TOKEN_ENV} "
            "to the same secret on every rank)") from None
    except OSError as e:
        raise RuntimeError(f"hemiola.ps: cannot read the job token file {path} that rank 0 "
                           f"published ({e}); set {JOB_TOKEN_ENV} to the same secret on every "
                           "rank") from None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise RuntimeError(
                f"hemiola.ps: the job token file {path} is not this user's private file (owner "
                f"uid {info.st_uid}, mode {info.st_mode & 0o777:o}): someone replaced the path "
                f"rank 0 published. Set {JOB_TOKEN_ENV} to the same secret on every rank")
        return f.read().strip()
