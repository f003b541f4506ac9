"""``benchmarks/compare.py --interleave``: goals measured with both systems in one process.

The goal lines are built from ``benchmarks/ab_overhead.py``'s JSON (no run here, except the one
slow test, which runs ``ab_overhead.py`` on the tiny model and reads what it wrote).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ab(peer: str, zinf: str, peer_steps, zinf_steps, spill: float = 0.0) -> dict:
    """What ``ab_overhead.py`` writes (``JSON=``) for two variants, peer first."""
    paired = [z / p for z, p in zip(zinf_steps, peer_steps)]
    srt = sorted(paired)
    return {"rounds": len(paired), "baseline": peer, "variants": {
        peer: {"median_step_s": sorted(peer_steps)[len(peer_steps) // 2], "paired": [1.0] * len(paired),
               "paired_median": 1.0, "paired_iqr": [1.0, 1.0], "zinf_threads_cpu_per_step_s": spill},
        zinf: {"median_step_s": sorted(zinf_steps)[len(zinf_steps) // 2], "paired": paired,
               "paired_median": (srt[len(srt) // 2 - 1] + srt[len(srt) // 2]) / 2,
               "paired_iqr": [srt[0], srt[-1]], "zinf_threads_cpu_per_step_s": 0.01}}}


def test_an_interleaved_goal_is_the_median_of_the_rounds_ratios(compare):
    """The verdict is the median of each round's zinf/peer ratio (0.98, 1.02, 1.04, 1.10 -> 1.03),
    never the ratio of the two variants' medians; the fresh-process ratio of the same goal rides along."""
    pair = compare._interleaved.PAIRS[0]
    res = dict(_ab("inductor", "zinf", [1.0, 1.0, 1.0, 1.0], [0.98, 1.02, 1.04, 1.10]), ok=True,
               goal=pair[0], goal_ratio=pair[3])
    rows = {"zinf-none-dp1": {"ok": True, "median_step_s": 1.07}, "inductor": {"ok": True, "median_step_s": 1.0}}
    (line,) = compare.interleaved_goals(rows, {"zinf-none-dp1": res})
    assert line == ("PASS zinf no offload <= 1.05x Inductor, interleaved in one process: 1.03x (median of 4 rounds' "
                    "ratios, IQR 0.98-1.10; 3 of 4 rounds within 1.05x); fresh processes (above): 1.07x")
    res["variants"]["zinf"]["paired_median"] = 1.06
    assert compare.interleaved_goals({}, {"zinf-none-dp1": res})[0].startswith("MISS")
    assert compare.interleaved_goals(rows, {}) == []  # not measured: no line


def test_work_zinf_leaves_inside_the_peers_steps_is_reported(compare):
    """zinf's threads busy while the peer steps would slow the peer and flatter zinf: the line says so."""
    pair = compare._interleaved.PAIRS[1]
    res = dict(_ab("fsdp2-cpu", "zinf-cpu", [1.0, 1.0], [0.8, 0.8], spill=0.02), ok=True, goal=pair[0],
               goal_ratio=pair[3])
    line = compare._interleaved.goal_line(res, None)
    assert line.startswith("PASS zinf CPU offload (dp 2) <= 0.9x FSDP2 CPUOffloadPolicy, interleaved in one process: 0.80x")
    assert line.endswith("; zinf's threads used 0.020 CPU s a step inside the peer's steps")
    # each system's step in a process of its own beside its step in the shared one (a run that failed: left out)
    res["alone"] = {"fsdp2-cpu": 0.95, "zinf-cpu": None}
    line = compare._interleaved.goal_line(res, None)
    assert line.endswith("inside the peer's steps; step together / alone in a process: fsdp2-cpu 1.000 / 0.950 s")


def test_no_interleaved_verdict_when_the_shared_process_slowed_the_peer_more(compare):
    """Beside zinf the peer stepped 1.00 s against 0.80 s alone, zinf 0.80 s both ways: the 0.80x would
    credit zinf with the peer's loss to the shared process, so the line gives no verdict. A peer that
    lost less than zinf (the ratio then errs against zinf) keeps the verdict."""
    inter = compare._interleaved
    pair = inter.PAIRS[1]
    res = dict(_ab("fsdp2-cpu", "zinf-cpu", [1.0, 1.0], [0.8, 0.8]), ok=True, goal=pair[0], goal_ratio=pair[3],
               alone={"fsdp2-cpu": 0.80, "zinf-cpu": 0.80})
    assert inter.shared_process_penalty(res) == pytest.approx(1.25)
    line = inter.goal_line(res, None)
    assert line.startswith("n/a  zinf CPU offload (dp 2) <= 0.9x FSDP2 CPUOffloadPolicy, interleaved in one process: 0.80x")
    assert line.endswith("; no verdict: beside zinf the peer stepped 25% slower, relative to zinf's own change, "
                         "than alone (over 5%)")
    res["alone"] = {"fsdp2-cpu": 0.97, "zinf-cpu": 0.70}  # zinf lost more (14%) than the peer (3%)
    assert inter.shared_process_penalty(res) < 1 and inter.goal_line(res, None).startswith("PASS")
    failed = {"ok": False, "why": "timed out", "goal": pair[0], "goal_ratio": pair[3]}
    assert compare._interleaved.goal_line(failed, 0.8) == (
        "n/a  zinf CPU offload (dp 2) <= 0.9x FSDP2 CPUOffloadPolicy, interleaved in one process: timed out")


def test_interleave_must_not_be_negative():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare.py"), "--interleave", "-1",
                        "--out", "/nonexistent-never-written"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--interleave -1: must be 0 (off) or a number of rounds" in p.stderr


@pytest.mark.slow  # four compiles of the tiny model: ~30 s on 2 cores (make test-slow)
def test_ab_overhead_writes_what_the_goal_reads(compare, tmp_path):
    """A real interleaved run of the tiny model: the JSON has every field ``goal_line`` reads, each round
    paired, each variant trained (finite loss)."""
    pair = compare._interleaved.PAIRS[0]
    res = compare._interleaved.run_pair(pair, "quick", 2, 4, 1, "default", 600, dict(os.environ),
                                        str(tmp_path / "log.txt"), compare._free_port)
    assert res["ok"], res.get("why")
    assert res["rounds"] == 2 and res["baseline"] == "inductor" and set(res["variants"]) == {"inductor", "zinf"}
    assert set(res["alone"]) == {"inductor", "zinf"} and all(v > 0 for v in res["alone"].values())
    z = res["variants"]["zinf"]
    assert len(z["paired"]) == 2 and z["paired_iqr"][0] <= z["paired_median"] <= z["paired_iqr"][1]
    assert all(math.isfinite(v["last_loss"]) for v in res["variants"].values())
    # a verdict, or none where the tiny model's millisecond steps made the shared-process check fire
    assert compare._interleaved.shared_process_penalty(res) > 0
    assert compare._interleaved.goal_line(res, None).split(" ", 1)[0] in ("PASS", "MISS", "n/a")
    assert json.dumps(res)  # stored in compare.json as it is
