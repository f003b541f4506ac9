"""Swap-file faults: checksums verified on read, truncated files, folders left by crashed runs.

Each test checks the engine's error names the file (and its key), or that only a dead run's folder
goes; the fix each guards is named in its docstring.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from zinf_runtime import swap
from zinf_runtime.swap import SwapConfig, SwapCorruptError, SwapEngine

KIB = 1024


def cfg(path, **kw) -> SwapConfig:
    kw.setdefault("block_size", 64 * KIB)
    kw.setdefault("queue_depth", 4)
    kw.setdefault("buffer_count", 2)
    kw.setdefault("buffer_size", 256 * KIB)
    return SwapConfig(nvme_path=str(path), **kw)


def data(nbytes: int = 300 * KIB + 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def test_hardware_crc32c_is_used_when_installed():
    """make setup installs google-crc32c: then the engine checksums with its library (CRC-32C), and
    it agrees with the package's own function; without it, zlib's crc32 (stats say which)."""
    import importlib.util
    import mmap
    import zlib

    buf = mmap.mmap(-1, 3 * 4096)
    buf.write(os.urandom(3 * 4096))
    view = memoryview(buf)[5:10_000]
    if importlib.util.find_spec("google_crc32c") is None:
        assert swap.CHECKSUM == "crc32" and swap._checksum(view) == zlib.crc32(view)
        return
    import google_crc32c

    assert swap.CHECKSUM == "crc32c"
    assert swap._checksum(view) == google_crc32c.value(bytes(view))
    assert swap._checksum(view[:0]) == 0


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("impl", ["default", "zlib"])
def test_flipped_byte_raises_naming_the_file(tmp_path, direct, impl, monkeypatch):
    """Fix: a checksum per block at write, verified at read (SwapEngine._sum); ``zlib``: the fallback
    when the hardware CRC-32C library is missing."""
    if impl == "zlib":
        monkeypatch.setattr(swap, "_CRC32C", None)
        monkeypatch.setattr(swap, "CHECKSUM", "crc32")
    with SwapEngine(cfg(tmp_path, direct_io=direct)) as e:
        t = data()
        e.write("u999.master", t).wait()
        path = e._file("u999.master")
        with open(path, "r+b") as f:  # one bit flipped in the third block
            f.seek(150 * KIB + 7)
            b = f.read(1)
            f.seek(150 * KIB + 7)
            f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(SwapCorruptError) as ei:
            e.read("u999.master", torch.empty_like(t)).wait()
        msg = str(ei.value)
        assert path in msg and "'u999.master'" in msg and "corrupt" in msg and "nvme_checksum" in msg, msg
        assert "bytes 131072..196608" in msg, msg  # the block holding the flipped byte
        e.write("u999.master", t).wait()  # a rewrite heals it
        out = torch.empty_like(t)
        e.read("u999.master", out).wait()
        assert torch.equal(out, t)


def test_checksum_off_reads_the_changed_bytes(tmp_path):
    """The option turns the check off: the same flip then goes unnoticed (what the check prevents)."""
    with SwapEngine(cfg(tmp_path, checksum=False)) as e:
        t = data()
        e.write("k", t).wait()
        with open(e._file("k"), "r+b") as f:
            f.seek(10)
            f.write(bytes([int(t[10]) ^ 0xFF]))
        out = torch.empty_like(t)
        e.read("k", out).wait()
        assert int(out[10]) == int(t[10]) ^ 0xFF and torch.equal(out[11:], t[11:])


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("keep", [0, 4096, 100 * KIB + 3])
def test_truncated_file_raises_naming_the_file(tmp_path, direct, keep):
    """Fix: a short read is reported as SwapCorruptError naming file, key and sizes (SwapEngine._truncated)."""
    with SwapEngine(cfg(tmp_path, direct_io=direct)) as e:
        t = data()
        e.write("u998.param", t).wait()
        path = e._file("u998.param")
        os.truncate(path, keep)
        with pytest.raises(SwapCorruptError) as ei:
            e.read("u998.param", torch.empty_like(t)).wait()
        msg = str(ei.value)
        assert path in msg and "'u998.param'" in msg and "truncated" in msg, msg
        assert f"{keep} bytes on disk, {t.numel()} were written" in msg, msg


def test_corrupt_slot_of_a_partitioned_parameter_names_it(tmp_path):
    """Through the store: the error names the parameter the swap key belongs to."""
    import zinf_runtime

    p = torch.nn.Parameter(torch.randn(64, 300))
    # no read cache: the partition's write would leave its value in memory (write-through) and the
    # read below would not touch the corrupted file
    pl = zinf_runtime.Placement(tier="nvme", compute_device=torch.device("cpu"), group=None, optim_tier="device",
                                swap=cfg(tmp_path), read_cache_bytes=0)
    zinf_runtime.partition([("fc.weight", p)], pl, False)
    h = zinf_runtime.handle_of(p)
    (h.param_copy or h.master).flush()  # the partition's write is on disk
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.startswith("k_")]
    assert len(files) == 1, files
    with open(files[0], "r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(SwapCorruptError, match=r"parameter 'fc\.weight'") as ei:
        h.full_data(torch.float32)
    assert files[0] in str(ei.value)


# -- folders left by crashed runs --------------------------------------------------------------------
def _spawn_engine(root, *extra: str) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import sys, time, torch
        from zinf_runtime.swap import SwapConfig, SwapEngine
        e = SwapEngine(SwapConfig({str(root)!r}))
        e.write("k", torch.ones(1 << 16)).wait()
        print(e.dir, flush=True)
        time.sleep(120)
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_sigkilled_run_folder_removed_live_and_foreign_kept(tmp_path):
    """Fix: each engine folder has an owner marker + held flock; a new engine removes only folders whose
    owner is gone (SwapEngine.__init__ -> _sweep_stale)."""
    dead, live = _spawn_engine(tmp_path), _spawn_engine(tmp_path)
    try:
        dead_dir, live_dir = dead.stdout.readline().strip(), live.stdout.readline().strip()
        assert os.path.isdir(dead_dir) and os.path.isdir(live_dir)
        owner = json.load(open(os.path.join(dead_dir, ".owner")))
        assert owner["pid"] == dead.pid and owner["created_by"] == "zinf_runtime.swap" and owner["start_time"]
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        assert os.path.isdir(dead_dir)  # SIGKILL ran no cleanup
        # never ours: a user's folder named zinf-*, a zinf-like folder without .lock, a plain file
        (tmp_path / "zinf-user-data").mkdir()
        (tmp_path / "zinf-user-data" / "x").write_text("keep")
        (tmp_path / "notes.txt").write_text("keep")
        # a folder whose flock is free but whose marker names a live process (e.g. this one): kept
        fake = tmp_path / "zinf-1-rank0-live"
        fake.mkdir()
        (fake / ".lock").write_text("")
        (fake / ".owner").write_text(json.dumps({"created_by": "zinf_runtime.swap", "pid": os.getpid(),
                                                 "host": os.uname().nodename,
                                                 "start_time": None}))
        # ... and one of another host sharing the disk: its pids are not ours to judge
        other = tmp_path / "zinf-2-rank0-otherhost"
        other.mkdir()
        (other / ".lock").write_text("")
        (other / ".owner").write_text(json.dumps({"created_by": "zinf_runtime.swap", "pid": 1 << 22,
                                                  "host": "some-other-host", "start_time": 1}))
        with pytest.warns(RuntimeWarning, match="removed 1 swap folder"):
            e = SwapEngine(cfg(tmp_path))
        try:
            assert e.swept == [dead_dir]
            assert not os.path.exists(dead_dir)
            left = sorted(os.listdir(tmp_path))
            assert left == sorted([os.path.basename(live_dir), os.path.basename(e.dir), "zinf-user-data",
                                   "notes.txt", "zinf-1-rank0-live", "zinf-2-rank0-otherhost"]), left
            assert (tmp_path / "zinf-user-data" / "x").read_text() == "keep"
        finally:
            e.close()
    finally:
        for p in (dead, live):
            if p.poll() is None:
                p.kill()
            p.wait(30)


def test_reused_pid_counts_as_dead(tmp_path):
    """A marker whose pid now belongs to a later process (other start time) is a dead run's."""
    d = tmp_path / "zinf-7-rank0-reused"
    d.mkdir()
    (d / ".lock").write_text("")
    (d / ".owner").write_text(json.dumps({"created_by": "zinf_runtime.swap", "pid": os.getpid(),
                                          "host": os.uname().nodename, "start_time": 1}))
    with pytest.warns(RuntimeWarning, match="crashed runs"):
        with SwapEngine(cfg(tmp_path)) as e:
            assert e.swept == [str(d)]
