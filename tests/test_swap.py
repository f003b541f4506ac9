"""Tests for the NVMe swap engine (zinf_runtime.swap): correctness, ordering,
crash safety on a full disk, path errors, cleanup and the buffered fallback."""
from __future__ import annotations

import errno
import inspect
import mmap
import os
import stat
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

from zinf_runtime.swap import SwapConfig, SwapEngine, SwapError, SwapPathError, SwapSpaceError

KIB = 1024
MIB = 1 << 20


def small_cfg(path, **kw) -> SwapConfig:
    """Small blocks so modest tensors span several chunks and threads."""
    kw.setdefault("block_size", 64 * KIB)
    kw.setdefault("queue_depth", 4)
    kw.setdefault("buffer_count", 2)
    kw.setdefault("buffer_size", 256 * KIB)
    return SwapConfig(nvme_path=str(path), **kw)


@pytest.fixture(params=[True, False], ids=["reuse", "replace"])
def eng(tmp_path, request):
    """Both write modes: ``reuse_files`` (two files per key, the spare overwritten) and tmp + rename."""
    e = SwapEngine(small_cfg(tmp_path, reuse_files=request.param))
    yield e
    e.close()


def rand_tensor(nbytes: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


@pytest.mark.parametrize("field,value", [
    ("nvme_path", ""), ("block_size", 1000), ("block_size", 0), ("block_size", True),
    ("queue_depth", 0), ("queue_depth", 1000), ("buffer_count", -1),
    ("buffer_size", 3 * 64 * KIB + 1), ("direct_io", 1),
])
def test_config_validation(field, value):
    kw = dict(nvme_path="/tmp", block_size=64 * KIB, queue_depth=4, buffer_count=2, buffer_size=256 * KIB)
    kw[field] = value
    with pytest.raises(ValueError, match=rf"SwapConfig\.{field}=.*fix"):
        SwapConfig(**kw)


def test_config_pool_must_cover_queue_depth():
    with pytest.raises(ValueError, match="buffer_count.*queue_depth"):
        SwapConfig("/tmp", block_size=MIB, queue_depth=8, buffer_count=1, buffer_size=4 * MIB)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * MIB + 17])
def test_round_trip_odd_sizes(eng, nbytes):
    t = rand_tensor(nbytes, torch.uint8, seed=nbytes)
    eng.write("p.odd", t).wait()
    assert eng.nbytes("p.odd") == nbytes
    out = torch.empty_like(t)
    eng.read("p.odd", out).wait()
    assert torch.equal(out, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int64, torch.int8, torch.bool, torch.complex64])
def test_round_trip_dtypes_bitwise(eng, dtype):
    esize = torch.empty(0, dtype=dtype).element_size()
    n = (200 * KIB + 3 * esize) // esize * esize  # not a multiple of 4096
    t = rand_tensor(n, torch.uint8, seed=esize).view(dtype) if dtype != torch.bool else \
        (rand_tensor(n, torch.uint8) & 1).bool()
    t = t.reshape(-1, 1)  # shape does not matter, only bytes
    eng.write(f"p.{dtype}", t).wait()
    out = torch.empty_like(t)
    eng.read(f"p.{dtype}", out).wait()
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))  # bitwise, NaNs included


@pytest.mark.parametrize("direct", [True, False])
def test_zero_copy_for_aligned_or_buffered(tmp_path, direct):
    n = 3 * MIB + 17
    m = mmap.mmap(-1, n + 4096)
    src = torch.frombuffer(m, dtype=torch.uint8)[:n]  # page-aligned storage
    src.copy_(rand_tensor(n, torch.uint8))
    dst = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)
    with SwapEngine(small_cfg(tmp_path, direct_io=direct)) as e:
        e.write("a", src).wait()
        e.read("a", dst).wait()
        assert torch.equal(dst, src)
        zc = e.stats()["zero_copy_bytes"]
        assert zc == (2 * n if not direct else 2 * (n // (64 * KIB)) * 64 * KIB)  # direct: tail via bounce
        unaligned = rand_tensor(n + 1, torch.uint8)[1:]
        e.write("b", unaligned).wait()
        out = torch.empty(n + 1, dtype=torch.uint8)[1:]
        e.read("b", out).wait()
        assert torch.equal(out, unaligned)
        assert (e.stats()["zero_copy_bytes"] > zc) == (not direct)


def test_noncontiguous_write_and_0d(eng):
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    eng.write("t", base.t()).wait()
    out = torch.empty(8, 8)
    eng.read("t", out).wait()
    assert torch.equal(out, base.t().contiguous())
    eng.write("s", torch.tensor(3.5)).wait()
    s = torch.empty(())
    eng.read("s", s).wait()
    assert s.item() == 3.5


def test_many_concurrent_handles(eng):
    tensors = {f"p{i}.master": rand_tensor(1 + (i * 7919) % (300 * KIB), torch.uint8, seed=i) for i in range(120)}
    handles = [eng.write(k, t) for k, t in tensors.items()]
    outs = {k: torch.empty_like(t) for k, t in tensors.items()}
    handles += [eng.read(k, outs[k]) for k in tensors]  # ordered after their writes, no wait needed
    for h in handles:
        h.wait()
    for k, t in tensors.items():
        assert torch.equal(outs[k], t), k
    st = eng.stats()
    total = sum(t.numel() for t in tensors.values())
    assert st["bytes_written"] == total and st["bytes_read"] == total
    assert st["writes"] == 120 and st["reads"] == 120 and st["keys"] == 120
    assert st["disk_bytes"] == sum((t.numel() + 4095) // 4096 * 4096 for t in tensors.values())
    assert st["peak_disk_bytes"] >= st["disk_bytes"] and st["busy_s"] > 0


def test_overwrite_keeps_latest_and_orders_per_key(eng):
    a, b, c = (rand_tensor(100 * KIB + i, torch.uint8, seed=i) for i in range(3))
    eng.write("k", a)
    eng.write("k", b[: b.numel() - 5])  # size change
    out_b = torch.empty(b.numel() - 5, dtype=torch.uint8)
    hr = eng.read("k", out_b)
    eng.write("k", c)
    out_c = torch.empty_like(c)
    eng.read("k", out_c).wait()
    hr.wait()
    assert torch.equal(out_b, b[:-5]) and torch.equal(out_c, c)
    assert eng.nbytes("k") == c.numel() and eng.stats()["keys"] == 1
    # no stale versions: the current file, and with reuse_files the spare (b's, as c changed size again)
    want = ["k_k.a", "k_k.b"] if eng.cfg.reuse_files else ["k_k"]
    assert sorted(os.listdir(eng.dir)) == [".lock", ".owner", *want]
    assert eng.stats()["disk_bytes"] == sum(os.path.getsize(os.path.join(eng.dir, n)) for n in want)


def test_reuse_files_overwrites_the_spare_in_place(tmp_path):
    """reuse_files: from the third write on, a key's writes land in its two files, alternating, with
    no new file (same inodes, so no allocation); remove(keep_file=True) forgets the value and keeps
    one file, which the next write overwrites."""
    e = SwapEngine(small_cfg(tmp_path, reuse_files=True))
    try:
        vals = [rand_tensor(200 * KIB, torch.uint8, seed=i) for i in range(5)]
        e.write("k", vals[0])
        e.write("k", vals[1]).wait()
        inodes = {n: os.stat(os.path.join(e.dir, n)).st_ino for n in ("k_k.a", "k_k.b")}
        disk = e.stats()["disk_bytes"]
        for i, v in enumerate(vals[2:], start=2):
            e.write("k", v).wait()
            out = torch.empty_like(v)
            e.read("k", out).wait()
            assert torch.equal(out, v), i
            assert e._file("k").endswith("ab"[i % 2]), i  # current side alternates
            assert {n: os.stat(os.path.join(e.dir, n)).st_ino for n in inodes} == inodes, i
            assert e.stats()["disk_bytes"] == disk == 2 * 200 * KIB
        e.remove("k", keep_file=True)
        assert not e.exists("k") and e.stats()["disk_bytes"] == 200 * KIB
        with pytest.raises(KeyError):
            e.read("k", torch.empty_like(vals[0]))
        (kept,) = [n for n in os.listdir(e.dir) if n.startswith("k_")]
        ino = os.stat(os.path.join(e.dir, kept)).st_ino
        e.write("k", vals[0]).wait()
        assert os.listdir(e.dir).count(kept) == 1 and os.stat(os.path.join(e.dir, kept)).st_ino == ino
        out = torch.empty_like(vals[0])
        e.read("k", out).wait()
        assert torch.equal(out, vals[0]) and e.stats()["disk_bytes"] == 200 * KIB
        e.remove("k")
        assert not [n for n in os.listdir(e.dir) if n.startswith("k_")] and e.stats()["disk_bytes"] == 0
    finally:
        e.close()


def test_long_same_key_chain_and_failed_write_then_read(eng):
    eng.write("k", torch.ones(MIB))
    hs = [eng.write("k", torch.empty(0)) for _ in range(3000)]  # all wait behind the first write
    for h in hs:
        h.wait()
    assert eng.nbytes("k") == 0

    gate = threading.Event()

    def fail(fd, bufs, off):
        gate.wait(10)
        raise OSError(errno.ENOSPC, "No space left on device")
    eng.write("j", torch.ones(10)).wait()
    eng._sys_pwritev = fail
    hw = eng.write("j", torch.ones(20))
    hr = eng.read("j", torch.empty(20))  # queued behind the failing write
    gate.set()
    with pytest.raises(SwapSpaceError):
        hw.wait()
    with pytest.raises(KeyError, match="preceding write failed"):
        hr.wait()
    assert eng.nbytes("j") == 40  # reverted to the committed version


def test_keys_are_escaped_without_collisions(eng):
    keys = ["x", "x.v1.tmp", ".", "..", "a/b", "a%2Fb", "ünï code", "k_x"]
    for i, k in enumerate(keys):
        eng.write(k, torch.full((10 + i,), i, dtype=torch.uint8))
    for i, k in enumerate(keys):
        out = torch.empty(10 + i, dtype=torch.uint8)
        eng.read(k, out).wait()
        assert bool((out == i).all()), k


def test_exists_remove_and_errors(eng):
    assert not eng.exists("k")
    with pytest.raises(KeyError):
        eng.read("k", torch.empty(1))
    eng.write("k", torch.ones(10))  # pending counts as existing
    assert eng.exists("k") and eng.nbytes("k") == 40
    with pytest.raises(ValueError, match="40"):
        eng.read("k", torch.empty(11))
    with pytest.raises(ValueError, match="contiguous"):
        eng.read("k", torch.empty(20)[::2])
    eng.remove("k")
    assert not eng.exists("k") and eng.stats()["disk_bytes"] == 0
    assert sorted(os.listdir(eng.dir)) == [".lock", ".owner"]
    eng.remove("k")  # idempotent


def test_read_io_error_reraised_in_caller(eng):
    eng.write("k", torch.ones(1000)).wait()

    def boom(fd, bufs, off):
        raise OSError(errno.EIO, "injected")
    eng._sys_preadv = boom
    with pytest.raises(OSError, match="injected") as ei:
        eng.read("k", torch.empty(1000)).wait()
    assert ei.value.errno == errno.EIO


def test_dir_private_and_removed_on_close(tmp_path):
    e = SwapEngine(small_cfg(tmp_path), rank=3)
    d = e.dir
    assert os.path.dirname(d) == str(tmp_path)
    assert os.path.basename(d).startswith(f"zinf-{os.getpid()}-rank3-")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    e.write("k", torch.ones(5000)).wait()
    e.close()
    e.close()  # idempotent
    assert not os.path.exists(d) and os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        e.write("k", torch.ones(1))
    with SwapEngine(small_cfg(tmp_path)) as e2:
        d2 = e2.dir
    assert not os.path.exists(d2)


def test_close_after_the_finalizer_ran_returns(tmp_path):
    """At interpreter exit an engine's finalizer (IO threads stopped, folder removed) runs before its
    owning context's, which then calls close(): waiting for IO still queued would hang the exit."""
    import threading

    e = SwapEngine(small_cfg(tmp_path))
    e.write("k", torch.ones(5000)).wait()
    d = e.dir
    e._finalizer()  # what garbage collection / atexit does
    assert not os.path.exists(d)
    with e._lock:
        e._inflight += 1  # a request queued behind the stopped threads, never to finish
    t = threading.Thread(target=e.close, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "close() waited for IO that can no longer run"
    with pytest.raises(RuntimeError, match="closed"):
        e.write("k", torch.ones(1))


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_removed_at_exit_and_stale_dirs_swept(tmp_path):
    # One process exits normally without close() (atexit cleanup), one dies hard (os._exit: no cleanup).
    r = run_py(f"""
        import os, sys, torch
        from zinf_runtime.swap import SwapConfig, SwapEngine
        keep = SwapEngine(SwapConfig({str(tmp_path)!r}))
        keep.write("k", torch.ones(1 << 16))  # pending at exit
    """)
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path) == []
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, torch
        from zinf_runtime.swap import SwapConfig, SwapEngine
        e = SwapEngine(SwapConfig({str(tmp_path)!r}))
        e.write("k", torch.ones(10)).wait(); os._exit(0)
    """)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert len(os.listdir(tmp_path)) == 1  # leaked by the hard exit
    live = SwapEngine(small_cfg(tmp_path))  # sweeps the dead run's dir ...
    assert os.listdir(tmp_path) == [os.path.basename(live.dir)]
    other = SwapEngine(small_cfg(tmp_path))  # ... but never a live engine's
    assert len(os.listdir(tmp_path)) == 2
    live.close(), other.close()


def test_bad_paths(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for bad in [tmp_path / "missing", f, f / "sub"]:
        with pytest.raises(SwapPathError, match="fix") as ei:
            SwapEngine(small_cfg(bad))
        assert str(bad) in str(ei.value)
        assert isinstance(ei.value, OSError) and isinstance(ei.value, SwapError)


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses directory permissions, chmod cannot make it unwritable")
def test_unwritable_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(SwapPathError, match="fix"):
            SwapEngine(small_cfg(ro))
    finally:
        ro.chmod(0o700)


def check_space_failure(e: SwapEngine, err: BaseException, old: torch.Tensor, other: torch.Tensor) -> None:
    assert isinstance(err, SwapSpaceError) and err.errno in (errno.ENOSPC, errno.EFBIG)
    assert e.dir in str(err) and "bytes" in str(err)
    out = torch.empty_like(old)
    e.read("a", out).wait()
    assert torch.equal(out, old)
    out = torch.empty_like(other)
    e.read("b", out).wait()
    assert torch.equal(out, other)
    assert not [n for n in os.listdir(e.dir) if n.endswith(".tmp")]
    assert e.nbytes("a") == old.numel() * old.element_size()


@pytest.mark.parametrize("direct,limit,falloc,reuse", [(True, 2 * MIB, True, True), (True, 2 * MIB + 100, False, True),
                                                        (False, 2 * MIB + 100, False, False)])
def test_out_of_space_rlimit_fsize(tmp_path, direct, limit, falloc, reuse):
    """falloc=False: fallocate unsupported, so the limit hits mid-write (short write, then EFBIG).
    With reuse_files the recovered write keeps the old version's file as its spare."""
    # RLIMIT_FSIZE caps each file; with SIGXFSZ ignored the kernel returns EFBIG like a full disk.
    head = textwrap.dedent("""
        import errno, os, resource, signal, torch
        from zinf_runtime.swap import SwapConfig, SwapEngine, SwapSpaceError
    """) + inspect.getsource(check_space_failure)
    r = run_py(head + textwrap.dedent(f"""
        def no_falloc(*a):
            raise OSError(errno.EOPNOTSUPP, "fallocate unsupported")
        if not {falloc}:
            os.posix_fallocate = no_falloc
        e = SwapEngine(SwapConfig({str(tmp_path)!r}, block_size=1 << 20, queue_depth=4,
                                  buffer_size=4 << 20, buffer_count=1, direct_io={direct},
                                  reuse_files={reuse}))
        g = torch.Generator().manual_seed(0)
        old = torch.randn(100_000, generator=g)
        other = torch.randn(333_333, generator=g)
        e.write("a", old); e.write("b", other).wait()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
        try:
            e.write("a", torch.randn(5 << 20, generator=g)).wait()
            raise SystemExit("no error")
        except OSError as err:
            check_space_failure(e, err, old, other)
            print("MSG", err)
        assert e.stats()["direct_io"] is {direct}  # a short write is not mistaken for "no O_DIRECT"
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        big = torch.randn(5 << 20, generator=g)
        e.write("a", big).wait()  # recovers once space is back
        out = torch.empty_like(big); e.read("a", out).wait(); assert torch.equal(out, big)
        spare = (400_000 + 4095) // 4096 * 4096 if {reuse} else 0  # reuse_files: old's file, the next spare
        assert e.stats()["disk_bytes"] == (20 << 20) + (333_333 * 4 + 4095) // 4096 * 4096 + spare
        e.close()
        print("OK")
    """))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert "needs 20971520 bytes" in r.stdout and "O_DIRECT not supported" not in r.stderr


def test_out_of_space_fault_hook(eng):
    old, other = rand_tensor(300 * KIB, torch.uint8, 1), rand_tensor(5 * KIB, torch.uint8, 2)
    eng.write("a", old)
    eng.write("b", other).wait()
    calls = []
    real = eng._sys_pwritev

    def flaky(fd, bufs, off):
        calls.append(off)
        if len(calls) >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, off)
    eng._sys_pwritev = flaky
    before = eng.stats()["disk_bytes"]
    with pytest.raises(SwapSpaceError, match="needs 1048576 bytes") as ei:
        eng.write("a", rand_tensor(MIB, torch.uint8, 3)).wait()
    assert eng.stats()["disk_bytes"] == before
    eng._sys_pwritev = real
    check_space_failure(eng, ei.value, old, other)
    # a failed first write of a new key leaves no key behind
    eng._sys_pwritev = flaky
    with pytest.raises(SwapSpaceError):
        eng.write("new", rand_tensor(MIB, torch.uint8, 4)).wait()
    assert not eng.exists("new")


def test_buffered_io_explicit(tmp_path):
    with SwapEngine(small_cfg(tmp_path, direct_io=False)) as e:
        t = rand_tensor(MIB + 3, torch.uint8)
        e.write("k", t).wait()
        out = torch.empty_like(t)
        e.read("k", out).wait()
        assert torch.equal(out, t) and e.stats()["direct_io"] is False


@pytest.mark.parametrize("where", ["open", "io"])
def test_automatic_fallback_injected(tmp_path, where):
    e = SwapEngine(small_cfg(tmp_path))
    real_open, real_w, real_r = e._sys_open, e._sys_pwritev, e._sys_preadv
    import fcntl

    def is_direct(fd):
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    def fake_open(path, flags):
        if where == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags)

    def guard(real):
        def f(fd, bufs, off):
            if where == "io" and is_direct(fd):
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, bufs, off)
        return f
    e._sys_open, e._sys_pwritev, e._sys_preadv = fake_open, guard(real_w), guard(real_r)
    t = rand_tensor(300 * KIB + 1, torch.uint8)
    with pytest.warns(RuntimeWarning, match="O_DIRECT not supported") as rec:
        e.write("k", t).wait()
        e.write("k2", t).wait()
        out = torch.empty_like(t)
        e.read("k", out).wait()
    assert len([w for w in rec if "O_DIRECT" in str(w.message)]) == 1  # warned once
    assert str(tmp_path) in str(rec[0].message)
    assert torch.equal(out, t) and e.stats()["direct_io"] is False
    e.close()


def _fs_without_o_direct() -> str | None:
    for d in ("/dev/shm", "/run", "/tmp"):
        p = os.path.join(d, f".zinf-odirect-probe-{os.getpid()}")
        try:
            fd = os.open(p, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return d
            continue
        os.close(fd)
        os.unlink(p)
    return None


def test_tmpfs_round_trip_and_real_fallback(tmp_path):
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with SwapEngine(small_cfg(shm)) as e:
            t = rand_tensor(100 * KIB + 7, torch.uint8)
            e.write("k", t).wait()
            out = torch.empty_like(t)
            e.read("k", out).wait()
            assert torch.equal(out, t)
    nodirect = _fs_without_o_direct()
    if nodirect is None:
        pytest.skip("every candidate filesystem (incl. tmpfs on this kernel) supports O_DIRECT; "
                    "the fallback is covered by test_automatic_fallback_injected")
    with pytest.warns(RuntimeWarning, match="O_DIRECT"):
        with SwapEngine(small_cfg(nodirect)) as e:
            e.write("k", t).wait()
            e.read("k", out).wait()
            assert torch.equal(out, t) and not e.stats()["direct_io"]


def test_pool_buffers_start_on_a_page_and_move_without_a_bounce_copy(tmp_path):
    """``BufferPool`` hands out page-aligned buffers (``tiers.aligned_empty``), reused as such, so the
    engine reads and writes their whole blocks straight from and into them (O_DIRECT); only a last
    partial block goes through a bounce slot. With the pool's old 64-byte aligned ``torch.empty`` every
    byte was copied once more on the IO threads."""
    from zinf_runtime import tiers

    pool = tiers.BufferPool()
    n = 3 * MIB + 20  # bytes; not a multiple of a block or a page
    for dtype in (torch.float32, torch.uint8, torch.bfloat16):
        t = pool.acquire(n // dtype.itemsize, dtype)
        assert t.data_ptr() % 4096 == 0 and t.numel() * dtype.itemsize == n // dtype.itemsize * dtype.itemsize
        pool.release(t)
        again = pool.acquire(n // dtype.itemsize, dtype)
        assert again.data_ptr() == t.data_ptr()  # reused, still aligned
        pool.release(again)
    # a donated buffer that is not the pool's (torch's first Adam states, an autograd gradient) is
    # not kept: every later acquire of its size would hand it out, and every byte of its IO would
    # go through a bounce slot
    foreign = torch.empty(4 * MIB + 64, dtype=torch.uint8)
    foreign = foreign[(4096 - foreign.data_ptr() % 4096) % 4096 + 64:][:4 * MIB]
    assert foreign.data_ptr() % 4096 == 64
    pool.release(foreign)
    assert pool.idle_bytes < 4 * MIB and pool.acquire(4 * MIB, torch.uint8).data_ptr() % 4096 == 0
    src, dst = pool.acquire(n, torch.uint8), pool.acquire(n, torch.uint8)
    src.copy_(rand_tensor(n, torch.uint8))
    with SwapEngine(small_cfg(tmp_path, direct_io=True)) as e:
        e.write("a", src).wait()
        e.read("a", dst).wait()
        assert torch.equal(dst, src)
        full_blocks = n // (64 * KIB) * 64 * KIB
        assert e.stats()["zero_copy_bytes"] == 2 * full_blocks


def test_slot_writes_go_through_aligned_buffers_unless_donated(tmp_path):
    """An NVMe slot's write of a tensor the caller keeps (or one needing a cast) is copied into a pooled,
    page-aligned buffer, so the engine writes it without a bounce copy; a donated CPU tensor is
    written from the caller's memory. Values survive either way. And the gradient shard a reduction
    fills is page-aligned for an NVMe gradient tier, a plain tensor (adoptable whole) otherwise."""
    import zinf_runtime

    n = 64 * 300
    g = torch.Generator().manual_seed(0)
    handles, params = {}, []  # a handle lives as long as its parameter
    for tier in ("nvme", "cpu"):
        p = torch.nn.Parameter(torch.randn(64, 300, generator=g))
        params.append(p)
        pl = zinf_runtime.Placement(tier=tier, compute_device=torch.device("cpu"), group=None, optim_tier=tier,
                                    swap=small_cfg(tmp_path, direct_io=True) if tier == "nvme" else None)
        zinf_runtime.partition([(f"{tier}.weight", p)], pl, False)
        handles[tier] = zinf_runtime.handle_of(p)
    h = handles["nvme"]
    eng = h.master.swap
    h.master.flush()
    zc = eng.stats()["zero_copy_bytes"]
    kept = torch.randn(n, dtype=torch.float64, generator=g)  # cast on the way: fp64 -> the slot's fp32
    want = kept.float()
    h.master.set(kept)
    kept.zero_()  # the caller may change it at once: the write reads the pooled copy
    assert torch.equal(h.master.get(), want)
    assert eng.stats()["zero_copy_bytes"] - zc == n * 4 // (64 * KIB) * 64 * KIB  # all but the last block
    donated = torch.randn(n, generator=g)
    h.master.set(donated.clone(), donate=True)
    assert torch.equal(h.master.get(), donated)

    shard = h.new_grad_shard(torch.device("cpu"))
    assert shard.dtype == torch.float32 and shard.numel() == h.shard_numel and shard.data_ptr() % 4096 == 0
    plain = handles["cpu"].new_grad_shard(torch.device("cpu"))
    assert plain.untyped_storage().nbytes() == 4 * plain.numel()  # Slot.adopt takes only a whole storage


def test_write_tracker_tells_slots_apart_by_identity(tmp_path):
    """Two NVMe slots with the same fields (tier, kind, size, key) are different resources: finishing
    one's write must not remove the other from the writes in flight, whose cap flushes the oldest.
    (``Slot`` was a field-compared dataclass, and the tracker's deque removed the first *equal* slot,
    with a linear scan on every read.)"""
    from zinf_runtime import tiers

    with SwapEngine(small_cfg(tmp_path)) as e:
        tracker = tiers.WriteTracker(cap_bytes=1 << 30)
        a, b = (tiers.Slot("nvme", "optim", 1024, torch.float32, torch.device("cpu"), swap=e, key="k")
                for _ in range(2))
        assert a is not b and a != b and len({a, b}) == 2
        tracker.track(a)
        tracker.track(b)
        assert tracker.bytes == 2 * 4096
        tracker.untrack(b)
        assert list(tracker._inflight) == [a] and tracker.bytes == 4096
        tracker.untrack(b)  # not in flight any more: nothing changes
        assert list(tracker._inflight) == [a] and tracker.bytes == 4096
        tracker.untrack(a)
        assert len(tracker) == 0 and tracker.bytes == 0


def test_deferred_set_is_written_only_when_evicted(tmp_path):
    """``Slot.set(..., defer=True)`` (write-back): the value stays in host memory and reads are served
    from it; ``drop`` discards it without any write; past the context's ``DirtyTracker`` cap the
    oldest deferred value is written back, and reads then come from disk with the same bytes."""
    from zinf_runtime import tiers
    from zinf_runtime.context import RuntimeContext

    ctx = RuntimeContext(name="write-back test")
    ctx.dirty.cap_bytes = 2 * 4096
    with SwapEngine(small_cfg(tmp_path)) as e:
        a, b, c = (tiers.Slot("nvme", "grad", 1024, torch.float32, torch.device("cpu"), swap=e, key=k, ctx=ctx)
                   for k in "abc")
        va, vb, vc = (torch.randn(1024) for _ in range(3))
        a.set(va, defer=True)
        b.set(vb.clone(), donate=True, defer=True)
        assert a.present and a.dirty is not None and e.stats()["writes"] == 0
        assert torch.equal(a.get(), va) and torch.equal(b.get_async(out=torch.empty(1024))[0], vb)
        assert e.stats()["reads"] == 0 and ctx.dirty.bytes == 2 * 4096
        b.drop()  # discarded, never written
        assert not b.present and ctx.dirty.bytes == 4096 and not e.exists("b")
        b.set(vb, defer=True)
        c.set(vc, defer=True)  # over the cap: the oldest (a) goes to disk
        assert a.dirty is None and ctx.dirty.written_back == 1 and ctx.dirty.bytes == 2 * 4096
        a.flush()
        assert e.stats()["writes"] == 1 and torch.equal(a.get(), va) and e.stats()["reads"] == 1
        for s in (a, b, c):
            s.drop()
        assert ctx.dirty.bytes == 0 and len(ctx.dirty) == 0
        assert ctx.accounting.stats()["nvme"]["grad"]["current"] == 0
