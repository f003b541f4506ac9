"""``benchmarks/compare.py --quick``: every requested row is in the JSON and the markdown, measured or with its why.

Two cheap rows run for real (eager, zinf dp 1) on the tiny model (an Inductor row would add one more
cold compile, ~20 s idle: the zinf row already compiles with Inductor underneath); the DeepSpeed row runs
with ``deepspeed`` made unimportable (a package on PYTHONPATH whose import raises, as on CI where it
is not installed), and must stay in the table with the error's first line instead of being dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run: minutes on 2 cores (make test-slow)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARE = os.path.join(ROOT, "benchmarks", "compare.py")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    hide = tmp / "hide" / "deepspeed"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError(\"No module named 'deepspeed' (hidden by test_compare)\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = tmp / "out"
    cmd = [sys.executable, COMPARE, "--quick", "--systems", "eager,zinf-none-dp1,ds-none", "--out", str(out),
           "--nvme-dir", str(tmp), "--timeout", "900"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out / "compare.json") as f:
        data = json.load(f)
    return data, (out / "compare.md").read_text(), p.stdout


def test_measured_rows_have_their_fields(quick_run):
    data, md, _ = quick_run
    rows = data["rows"]["quick"]
    assert set(rows) == {"eager", "zinf-none-dp1", "ds-none"}
    for name in ("eager", "zinf-none-dp1"):
        r = rows[name]
        assert r["ok"], r
        assert r["dp"] == 1 and len(r["step_s"]) == 2 and len(r["warmup_s"]) == 1
        assert r["median_step_s"] > 0 and r["first_step_s"] > 0
        assert r["rss_sum_mib"] >= r["rss_max_mib"] > 0
        assert len(r["losses"]) == 4
        assert r["disk_read_per_step"] >= 0 and r["disk_write_per_step"] >= 0  # /proc/self/io, per timed step
        # getrusage over the timed steps: a step costs CPU, at most the machine's cores for its wall time
        assert 0 < r["cpu_per_step_s"] <= (os.cpu_count() or 1) * sum(r["step_s"]) + 0.05, r
        # the timed steps' own peak (VmHWM reset after the warm-up): never above the whole run's
        steps = r["rss_hwm_steps_kib"]
        assert steps is not None and len(steps) == 1 and 0 < steps[0] <= r["rss_hwm_kib"][0]
        assert r["adam"] == "default"
    # the same model, data and optimizer: the first step's loss (before any update) is the same everywhere
    first = [rows[n]["losses"][0] for n in ("eager", "zinf-none-dp1")]
    assert max(first) - min(first) < 1e-5, first
    for field in ("cpu", "cores", "ram_gib", "disk"):
        assert field in data["machine"]
    assert "disk MiB/step read / write" in md and "timed steps' peak RSS" in md and "CPU s/step (sum)" in md
    assert "Machine:" in md and "Load average" in md and "Global batch 4" in md


def test_unavailable_system_says_why(quick_run):
    data, md, out = quick_run
    ds = data["rows"]["quick"]["ds-none"]
    assert not ds["ok"]
    assert ds["why"].startswith("ImportError: No module named 'deepspeed'"), ds["why"]
    assert "| DeepSpeed ZeRO-3 | 2 | not run: ImportError: No module named 'deepspeed'" in md
    assert "not run: ImportError" in out


def test_rerun_merges_rows(quick_run, tmp_path):
    """--systems re-runs only its rows; the other rows keep their numbers (cheap: the failing ds row only)."""
    data, _, _ = quick_run
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "compare.json", "w") as f:
        json.dump(data, f)
    hide = tmp_path / "hide" / "deepspeed"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError(\"No module named 'deepspeed' (hidden again)\")\n")
    env = dict(os.environ, PYTHONPATH=str(hide.parent))
    p = subprocess.run([sys.executable, COMPARE, "--quick", "--systems", "ds-none", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out / "compare.json") as f:
        merged = json.load(f)["rows"]["quick"]
    assert set(merged) == {"eager", "zinf-none-dp1", "ds-none"}
    for name in ("eager", "zinf-none-dp1"):
        assert merged[name] == data["rows"]["quick"][name]
    assert "hidden again" in merged["ds-none"]["why"]
    md = (out / "compare.md").read_text()
    assert f"| zinf | 1 | {merged['zinf-none-dp1']['median_step_s']:.3f} |" in md and "hidden again" in md
