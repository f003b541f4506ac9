"""Smoke test of benchmarks/overlap.py and benchmarks/fetch_bandwidth.py in their --quick modes.

Why: the two scripts are issue 9's acceptance measurements; a refactor of the runtime must not
silently break them (a missing row, a zero byte count, a ratio computed from the wrong rows). Both
run as the user runs them, in subprocesses (each of overlap.py's rows is a fresh process of its
own), side by side, with a timeout; the test checks the JSON they write, including that the
derived figures follow from the measured ones. It says nothing about speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run: minutes on 2 cores (make test-slow)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
TIMEOUT = 600  # a shared 2-core machine can be many times slower than an idle one


def _start(script: str, args: list[str], log: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = open(log, "w")
    return subprocess.Popen([sys.executable, os.path.join(BENCH, script)] + args, stdout=out,
                            stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _finish(proc: subprocess.Popen, log: str) -> None:
    try:
        rc = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{proc.args[1]} did not finish in {TIMEOUT} s; log:\n{open(log).read()[-4000:]}")
    assert rc == 0, open(log).read()[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both scripts' JSON, from one concurrent run of each (the test's cost is the slower one)."""
    d = tmp_path_factory.mktemp("overlap_bench")
    trace = d / "trace.json"
    ov = _start("overlap.py", ["--quick", "--compiler", "eager", "--layers", "1", "--threads", "1",
                               "--rows", "serial,scheduled,memory,transfer", "--transfer-repeat", "2",
                               "--trace", str(trace), "--out", str(d), "--name", "ov"], str(d / "ov.log"))
    fb = _start("fetch_bandwidth.py", ["--quick", "--dp", "1", "--layers", "1", "--out", str(d), "--name", "fb"],
                str(d / "fb.log"))
    _finish(ov, str(d / "ov.log"))
    _finish(fb, str(d / "fb.log"))
    with open(d / "ov.json") as f:
        ov_json = json.load(f)
    with open(d / "fb.json") as f:
        fb_json = json.load(f)
    return ov_json, fb_json, d, (d / "ov.log").read_text()


def test_overlap_rows_and_derived_figures(runs):
    ov, _, d, log = runs
    res = ov["results"]
    assert set(res) == {"serial", "scheduled", "memory", "transfer"}
    for name, r in res.items():
        for key in ("median_step_s", "first_step_s", "min_step_s", "peak_rss_mib"):
            assert r[key] > 0, (name, key, r[key])
    for name in ("serial", "scheduled", "memory"):
        r = res[name]
        assert len(r["step_times_s"]) == ov["args"]["steps"] == 2
        assert all(t > 0 for t in r["step_times_s"])
        assert r["params"] > 0
    assert res["serial"]["options"]["prefetch_depths"] == [0, 0, 0]
    assert res["serial"]["options"]["reduce_depths"] == [0, 0]
    assert "prefetch_depths" not in res["scheduled"]["options"]  # the Config defaults
    assert res["memory"]["options"]["offload_params"] == "none"
    nv = res["serial"]["nvme"]
    assert nv["bytes_read_per_step"] > 0 and nv["bytes_written_per_step"] > 0 and nv["file_sizes"]
    # the transfer row moved (at least, to the next whole file) the serial row's bytes of one step
    t = res["transfer"]
    assert nv["bytes_read_per_step"] <= t["read_bytes"] < nv["bytes_read_per_step"] + max(nv["file_sizes"])
    assert nv["bytes_written_per_step"] <= t["write_bytes"] < nv["bytes_written_per_step"] + max(nv["file_sizes"])
    assert t["page_cache_dropped"] is True and isinstance(t["direct_io"], bool)
    s = ov["summary"]
    assert s["compute_s"] == res["memory"]["median_step_s"]
    assert s["transfer_s"] == t["median_step_s"]
    assert s["bound_s"] == max(s["compute_s"], s["transfer_s"])
    assert s["serial_over_scheduled"] == pytest.approx(res["serial"]["median_step_s"] / res["scheduled"]["median_step_s"])
    assert s["scheduled_over_bound"] == pytest.approx(res["scheduled"]["median_step_s"] / s["bound_s"])
    md = (d / "ov.md").read_text()
    assert "serial / scheduled" in md and "scheduled / bound" in md and "page cache dropped" in md
    # the trace is the runtime's job: either it appeared, or the report says it did not
    assert ("written by the runtime" in md) == ov["meta"]["trace_exists"]
    assert "trace:" in log


def test_fetch_bandwidth_dp1(runs):
    _, fb, _, _ = runs
    from zinf_compile.models import GPT, GPTConfig

    dims = fb["model"]
    n = sum(p.numel() for p in GPT(GPTConfig(**dims)).parameters())
    rows = {(r["tier"], r["scheme"]): r for r in fb["results"]}
    assert set(rows) == {(t, s) for t in ("cpu", "nvme") for s in ("bandwidth-centric", "broadcast")}
    for (tier, scheme), r in rows.items():
        assert r["dp"] == 1
        assert r["param_bytes"] == 4 * n
        assert r["median_s"] > 0 and r["gbps"] == pytest.approx(r["param_bytes"] / r["median_s"] / 1e9)
        assert r["emulated"] is False  # both are zinf's runtime (partition="bandwidth" / "broadcast")
        assert r["partition"] == {"bandwidth-centric": "bandwidth", "broadcast": "broadcast"}[scheme]
        assert r["slow_read_bytes_this_rank"] >= r["param_bytes"]  # dp = 1: this rank reads everything
        assert (r["direct_io"] is None) == (tier == "cpu")
    for tier in ("cpu", "nvme"):
        a, b = rows[(tier, "bandwidth-centric")], rows[(tier, "broadcast")]
        assert fb["ratios"][f"{tier}/dp1"] == pytest.approx(a["gbps"] / b["gbps"])
