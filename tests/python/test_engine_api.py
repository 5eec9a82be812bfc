"""The engine's Python surface used directly, without torch.distributed:
rendezvous through a FileStore, collectives in every dtype, clear errors."""

from __future__ import annotations

import multiprocessing as mp
import tempfile

import numpy as np
import pytest
import torch

from hemiola._native import C


def _rank(rank: int, world: int, store_dir: str, out: mp.Queue) -> None:
    engine = C.Engine(rank, world, C.FileStore(store_dir), hostname="127.0.0.1", timeout_s=30)
    got = {}
    for dtype, np_dtype in (("float32", np.float32), ("float64", np.float64),
                            ("float16", np.float16)):
        a = np.full(1001, rank + 1, dtype=np_dtype)
        engine.all_reduce(a.ctypes.data, int(getattr(C.DType, dtype)), a.size,
                          C.ReduceOp.average).wait()
        got[dtype] = float(a[-1])
    b = np.full(7, 99 if rank == 0 else -1, dtype=np.int64)
    engine.broadcast(b.ctypes.data, int(C.DType.int64), b.size, 0).wait()
    got["broadcast"] = int(b[3])
    mine = np.array([rank * 10], dtype=np.int32)
    everyone = np.zeros(world, dtype=np.int32)
    engine.all_gather(mine.ctypes.data, everyone.ctypes.data, int(C.DType.int32), 1).wait()
    got["gather"] = everyone.tolist()
    engine.barrier().wait()
    out.put((rank, got))


def test_file_store_rendezvous_and_collectives() -> None:
    world = 3
    store_dir = tempfile.mkdtemp(prefix="hemiola-test-")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, store_dir, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    for got in results.values():
        assert got["float32"] == got["float64"] == got["float16"] == 2.0
        assert got["broadcast"] == 99
        assert got["gather"] == [0, 10, 20]


def test_bad_arguments_raise_value_errors() -> None:
    engine = C.Engine(0, 1, C.MemoryStore())
    a = np.zeros(4, dtype=np.int32)
    with pytest.raises(ValueError, match="only floating dtypes can be averaged"):
        engine.all_reduce(a.ctypes.data, int(C.DType.int32), 4, C.ReduceOp.average)
    with pytest.raises(ValueError, match="outside"):
        engine.broadcast(a.ctypes.data, int(C.DType.int32), 4, 3)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        C.Engine(2, 2, C.MemoryStore())
    with pytest.raises(ValueError, match="int64"):
        engine.make_reducer([(int(C.DType.int64), 3, "counter")], 1024, 1024)


def test_rendezvous_timeout_names_the_missing_key() -> None:
    with pytest.raises(C.HemiolaTimeoutError, match="not set"):
        C.Engine(0, 2, C.MemoryStore(), hostname="127.0.0.1", timeout_s=0.3)
    assert issubclass(C.HemiolaTimeoutError, TimeoutError)
    assert issubclass(C.HemiolaTimeoutError, C.HemiolaError)


def test_the_staged_chunk_size_comes_from_the_environment(monkeypatch) -> None:
    from hemiola.distributed import staged_chunk_bytes

    monkeypatch.delenv("HEMIOLA_STAGED_CHUNK_MB", raising=False)
    assert staged_chunk_bytes() == 0
    monkeypatch.setenv("HEMIOLA_STAGED_CHUNK_MB", "4")
    assert staged_chunk_bytes() == 4 << 20
    monkeypatch.setenv("HEMIOLA_STAGED_CHUNK_MB", "0.5")
    assert staged_chunk_bytes() == 1 << 19
    for bad, why in (("four", "not a number"), ("-1", "negative"), ("nan", "finite number"),
                     ("inf", "finite number"), ("1e30", "finite number")):
        monkeypatch.setenv("HEMIOLA_STAGED_CHUNK_MB", bad)
        with pytest.raises(ValueError, match=why):
            staged_chunk_bytes()


def test_a_timeout_the_clocks_cannot_hold_is_refused_naming_the_option() -> None:
    import hemiola

    for bad in (float("inf"), float("nan"), 9.3e9, 0, -1.0, "300"):
        with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds"):
            hemiola.Config(timeout_s=bad)
        with pytest.raises(ValueError, match=r"hemiola.init's timeout_s must be a number"):
            hemiola.init(timeout_s=bad)
    assert hemiola.Config(timeout_s=1e9).timeout_s == 1e9


def test_packed_bytes_come_back_as_the_tensors() -> None:
    from hemiola.engine_tensors import pack_bytes, unpack_bytes

    torch.manual_seed(0)
    tensors = [torch.randn(3, 5), torch.arange(7), torch.randn(11).half(), torch.tensor(5),
               torch.randn(2, 3, dtype=torch.float64)]
    flat, offsets = pack_bytes(tensors)
    assert all(o % 16 == 0 for o in offsets)
    targets = [torch.zeros_like(t) for t in tensors]
    unpack_bytes(flat, offsets, targets)
    assert all(torch.equal(a, b) for a, b in zip(tensors, targets))
    layout, same = pack_bytes(tensors, fill=False)  # a receiver: the layout only
    assert same == offsets and layout.shape == flat.shape and not layout.any()


def test_the_gloo_stripes_come_from_the_environment(monkeypatch) -> None:
    from hemiola.distributed import gloo_stripes

    monkeypatch.delenv("HEMIOLA_GLOO_STRIPES", raising=False)
    assert gloo_stripes() == 1
    monkeypatch.setenv("HEMIOLA_GLOO_STRIPES", "3")
    assert gloo_stripes() == 3
    for bad, why in (("two", "whole number"), ("0", "between 1 and 16"), ("17", "between")):
        monkeypatch.setenv("HEMIOLA_GLOO_STRIPES", bad)
        with pytest.raises(ValueError, match=why):
            gloo_stripes()

