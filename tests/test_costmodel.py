"""zinf_compile.costmodel: link bandwidths measured once per machine, cached on disk, reused.

The measurements themselves are real (1 MiB transfers through zinf's swap engine and copies, a
fraction of a second); the tests count how often they run, by wrapping the measuring functions.
"""

from __future__ import annotations

import json
import os

import pytest

from zinf_compile import cli, costmodel
from zinf_compile.costmodel import Bandwidths, bandwidths, cache_path, machine_key

MB = 1 << 20


@pytest.fixture
def counted(monkeypatch):
    """How many times each link was measured."""
    calls = {"disk": 0, "copies": 0}
    disk, copies = costmodel._measure_disk, costmodel._measure_copies

    def count_disk(*a, **k):
        calls["disk"] += 1
        return disk(*a, **k)

    def count_copies(*a, **k):
        calls["copies"] += 1
        return copies(*a, **k)

    monkeypatch.setattr(costmodel, "_measure_disk", count_disk)
    monkeypatch.setattr(costmodel, "_measure_copies", count_copies)
    return calls


def test_measured_once_then_read_from_cache(tmp_path, counted):
    disk, cache = tmp_path / "disk", tmp_path / "cache"
    disk.mkdir()
    first = bandwidths(str(disk), cache_dir=str(cache), measure_bytes=MB)
    assert counted == {"disk": 1, "copies": 1} and not first.cached
    for v in (first.disk_read, first.disk_write, first.h2d, first.d2h):
        assert v > 0
    assert first.all_gather == {} and first.reduce_scatter == {}  # dp = 1: no collective
    assert os.path.dirname(first.path) == str(cache) and os.path.isfile(first.path)
    assert not [p for p in disk.iterdir()], "the measurement's swap folder is removed"
    second = bandwidths(str(disk), cache_dir=str(cache), measure_bytes=MB)
    assert counted == {"disk": 1, "copies": 1}, "the second call re-measured"
    assert second.cached and second.path == first.path
    assert (second.disk_read, second.disk_write, second.h2d, second.d2h) == \
           (first.disk_read, first.disk_write, first.h2d, first.d2h)
    bandwidths(str(disk), cache_dir=str(cache), measure_bytes=MB, refresh=True)
    assert counted == {"disk": 2, "copies": 2}
    with open(first.path) as f:
        assert json.load(f)["key"] == machine_key(str(disk))


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 1, "key": {}}),
                                     "NEGATIVE"])
def test_corrupt_cache_is_measured_again_with_a_warning(tmp_path, counted, content):
    cache = tmp_path / "cache"
    first = bandwidths(None, cache_dir=str(cache), measure_bytes=MB)
    if content == "NEGATIVE":  # a well-formed record with an impossible rate
        with open(first.path) as f:
            d = json.load(f)
        d["h2d"] = -1.0
        content = json.dumps(d)
    with open(first.path, "w") as f:
        f.write(content)
    with pytest.warns(RuntimeWarning, match="unusable.*measuring again"):
        again = bandwidths(None, cache_dir=str(cache), measure_bytes=MB)
    assert counted["copies"] == 2 and not again.cached and again.h2d > 0
    with open(first.path) as f:  # overwritten with a good record: the next call reads it
        Bandwidths.from_json(json.load(f))
    assert bandwidths(None, cache_dir=str(cache), measure_bytes=MB).cached and counted["copies"] == 2


def test_a_record_of_another_machine_is_not_used(tmp_path, counted):
    cache = tmp_path / "cache"
    first = bandwidths(None, cache_dir=str(cache), measure_bytes=MB)
    with open(first.path) as f:
        d = json.load(f)
    d["key"]["host"] = "some-other-host"
    with open(first.path, "w") as f:
        json.dump(d, f)
    with pytest.warns(RuntimeWarning, match="another machine"):
        bandwidths(None, cache_dir=str(cache), measure_bytes=MB)
    assert counted["copies"] == 2


def test_key_follows_the_paths_filesystem(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    # two folders of one filesystem share the record: it describes the disk, not the folder
    assert machine_key(str(a)) == machine_key(str(b))
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp_path")
    ka, ks = machine_key(str(a)), machine_key(shm)
    assert ka["nvme"] != ks["nvme"] and ka["nvme"]["st_dev"] != ks["nvme"]["st_dev"]
    assert ks["nvme"]["fstype"] == "tmpfs" and ks["nvme"]["mount"] == "/dev/shm"
    assert cache_path(ka) != cache_path(ks)
    assert machine_key(None) != ka  # no disk at all is a third record
    # and the swap engine's settings are part of it (O_DIRECT and checksums change the disk rate)
    from zinf_runtime.swap import SwapConfig

    assert machine_key(str(a), swap=SwapConfig(str(a), checksum=False)) != ka


def test_cli_bandwidth_prints_then_reuses(tmp_path, capsys, counted):
    argv = ["bandwidth", "--cache-dir", str(tmp_path / "c"), "--nvme-path", str(tmp_path), "--measure-bytes", "1MiB"]
    assert cli.main(argv + ["--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["cached"] is False and first["disk_read"] > 0 and first["key"]["nvme"]["mount"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "read from cache" in text and "disk read (swap engine)" in text and "host -> device" in text
    assert counted == {"disk": 1, "copies": 1}
    assert cli.main(["bandwidth", "--nvme-path", str(tmp_path / "missing")]) == 2
    assert "not an existing directory" in capsys.readouterr().err


def test_plan_measured_takes_the_cached_bandwidth(tmp_path, capsys, monkeypatch, counted):
    monkeypatch.setenv("ZINF_CACHE_DIR", str(tmp_path))
    key = machine_key(str(tmp_path))
    costmodel._write_cache(cache_path(key), Bandwidths(key=key, disk_read=2e9, disk_write=1e9, h2d=5e9, d2h=5e9))
    plan = ["plan", "--layers", "4", "--hidden", "1024", "--heads", "16", "--seq", "512", "--batch", "1", "--json"]
    cli.main(plan + ["--measured", "--nvme-path", str(tmp_path)])
    measured = json.loads(capsys.readouterr().out)
    assert counted == {"disk": 0, "copies": 0}  # the crafted record was used, nothing measured
    cli.main(plan + ["--bandwidth", "2GB/s"])  # the slower link: disk read
    assert measured == json.loads(capsys.readouterr().out)
    cli.main(plan + ["--bandwidth", "5GB/s"])
    assert measured != json.loads(capsys.readouterr().out)
    assert cli.main(plan + ["--measured", "--bandwidth", "1GB/s"]) == 2
    assert "pass one of them" in capsys.readouterr().err


def test_seconds_and_collective_lookup():
    bw = Bandwidths(key={}, disk_read=1e9, disk_write=None, h2d=4e9, d2h=2e9,
                    all_gather={1 << 16: 1e8, 1 << 20: 1e9}, reduce_scatter={})
    assert bw.seconds("h2d", 8e9) == pytest.approx(2.0)
    assert bw.seconds("disk_write", 1) is None
    assert bw.collective("all_gather", 1000) == 1e8  # nearest measured size at or above
    assert bw.collective("all_gather", 1 << 30) == 1e9  # above every size: the largest
    assert bw.collective("reduce_scatter", 1) is None
    with pytest.raises(ValueError, match="multiple of 4096"):
        costmodel.measure(None, measure_bytes=1000)


@pytest.mark.slow
def test_dp2_collectives_measured_together_and_cached(tmp_path):
    import socket
    import subprocess
    import sys

    out = tmp_path / "res.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = os.path.join(os.path.dirname(__file__), "workers", "costmodel_dp.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), worker, str(out), str(tmp_path / "cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2
    for r in rows:
        assert r["world"] == 2
        assert (r["first_cached"], r["second_cached"], r["third_cached"]) == (False, True, False)
        assert r["after_second"] == 1, "the second call re-measured"
        assert r["after_third"] == 2, "one rank's missing cache makes every rank measure"
        for kind in ("all_gather", "reduce_scatter"):
            assert sorted(map(int, r[kind])) == [1 << 16, 1 << 20] and all(v > 0 for v in r[kind].values())
