"""Smoke runs of the two probes behind the README's "where a dp-2 step goes" figures.

``benchmarks/step_phases.py`` on a tiny GPT at dp 1 with the eager compiler (seconds, not the 25M
model's minute of Inductor compile) must print every phase, the main thread's CPU, the peak RSS lines and the GC line;
``benchmarks/rss_baseline.py`` must measure the ``torch`` row and refuse an unknown row by name.
They check the probes run and report, not any figure: figures belong to the benchmarks' runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"vocab": 64, "seq": 16, "layers": 1, "hidden": 32, "heads": 2}


def run(args: list, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, **env))


def test_step_phases_reports_phases_threads_and_gc():
    p = run(["benchmarks/step_phases.py", json.dumps({"compiler": "eager"})], CFG=json.dumps(TINY), STEPS="5")
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "dp 1, 2 steps counted" in out, out
    m = re.search(r"median s: fwd\+bwd ([\d.]+), step ([\d.]+), zero_grad ([\d.]+), total ([\d.]+)", out)
    assert m and float(m.group(4)) > 0, out
    # the main thread's row always shows; its CPU comes in 10 ms ticks, so a toy step may read 0
    assert re.search(r"^\s+MainThread\s+[\d.]+\s+\d+\s+\d+$", out, re.M), out
    rss = re.search(r"rank 0 peak RSS: up to step 3 (\d+) MiB \(with the compile\); steps 3\.\. (\d+ MiB|not measured)", out)
    assert rss and int(rss.group(1)) > 50, out
    assert re.search(r"gc per step: collections by generation \[[\d., ]+\], seconds \[[\d., ]+\]", out), out


def test_rss_baseline_measures_a_row_and_names_an_unknown_one():
    p = run(["benchmarks/rss_baseline.py", "torch"])
    assert p.returncode == 0, p.stdout + p.stderr
    row = re.search(r"^\| torch \| (\d+) \| (\d+) \| (True|False) \|$", p.stdout, re.M)
    assert row and int(row.group(1)) >= int(row.group(2)) > 50, p.stdout  # torch alone is > 50 MiB resident
    bad = run(["benchmarks/rss_baseline.py", "nosuch"])
    assert bad.returncode != 0 and "unknown rows ['nosuch']" in bad.stderr, bad.stderr
