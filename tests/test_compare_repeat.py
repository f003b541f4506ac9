"""``benchmarks/compare.py --repeat``: how repeated runs of a row become one row (no run is started here)."""

from __future__ import annotations

import pytest


def _run(step: float, first: float, at: str) -> dict:
    return {"ok": True, "median_step_s": step, "first_step_s": first, "run_at": at, "losses": [1.0]}


def test_repeated_runs_give_the_median_step_and_one_real_run(compare):
    runs = [_run(1.30, 50.0, "a"), _run(1.10, 51.0, "b"), _run(1.20, 52.0, "c")]
    row = compare.combine_runs(runs)
    assert row["median_step_s"] == 1.20 and row["runs_median_step_s"] == [1.30, 1.10, 1.20]
    assert row["first_step_s"] == 52.0 and row["run_at"] == "c"  # the figures of the middle run itself
    assert row["runs_at"] == ["a", "b", "c"] and row["failed_runs"] == []
    assert compare._step_cell(row) == "1.200 (3 runs: 1.100–1.300)"
    even = compare.combine_runs(runs[:2])
    assert even["median_step_s"] == pytest.approx(1.20) and even["first_step_s"] == 51.0  # the lower middle


def test_a_single_run_is_unchanged_and_failures_are_kept(compare):
    one = _run(1.0, 2.0, "a")
    assert compare.combine_runs([one]) is one and compare._step_cell(one) == "1.000"
    bad = {"ok": False, "why": "timed out", "run_at": "b"}
    mixed = compare.combine_runs([one, bad, _run(3.0, 4.0, "c")])
    assert mixed["median_step_s"] == 2.0 and mixed["failed_runs"] == ["timed out"]
    assert compare._step_cell(mixed).endswith("(1 failed)")
    none_ok = compare.combine_runs([bad, dict(bad, why="exit status 1")])
    assert not none_ok["ok"] and none_ok["why"] == "exit status 1"
    assert none_ok["failed_runs"] == ["timed out", "exit status 1"]


def test_a_goal_never_compares_rows_stepped_with_different_adamw_kernels(compare):
    """Rows merged from an ``--adam fused`` run and a default run: the goal says so instead of a
    ratio that would credit (or blame) the optimizer kernel; DeepSpeed rows (``adam`` None) compare
    with either."""
    rows = {"zinf-cpu-dp2": dict(_run(0.7, 40.0, "a"), adam="fused", dp=2, rss_sum_mib=900),
            "fsdp2-cpu": dict(_run(0.8, 1.0, "b"), adam="default", dp=2, rss_sum_mib=1000),
            "ds-cpu": dict(_run(0.9, 1.0, "c"), adam=None, dp=2, rss_sum_mib=1100)}
    out = compare.goals(rows)
    fsdp = next(g for g in out if "FSDP2" in g)
    assert fsdp.startswith("n/a") and "fused AdamW kernel" in fsdp and "default one" in fsdp
    ds = next(g for g in out if "< DeepSpeed CPU" in g)
    assert ds == "PASS zinf CPU offload (dp 2) < DeepSpeed CPU offload: 0.78x"
    rows["fsdp2-cpu"]["adam"] = "fused"
    assert next(g for g in compare.goals(rows) if "FSDP2" in g).startswith("PASS")


def test_a_goal_over_repeated_rounds_shows_each_rounds_ratio(compare):
    """``--repeat``: the verdict stays the ratio of the two medians; each round's own ratio (rows run
    minutes apart, so the machine's drift mostly cancels) is listed after it, and only when both
    rows finished every round."""
    def rep(steps, **kw):
        return dict(_run(sorted(steps)[(len(steps) - 1) // 2], 1.0, "a"), runs_median_step_s=steps, failed_runs=[],
                    dp=2, rss_sum_mib=1000, adam=None, **kw)

    rows = {"zinf-nvme-dp2": rep([1.2, 1.3, 1.5]), "ds-nvme": rep([1.6, 1.5, 1.8])}  # medians 1.3 and 1.6
    line = next(g for g in compare.goals(rows) if g.split(" ", 1)[1].startswith("zinf NVMe"))
    assert line == ("MISS zinf NVMe offload (dp 2) <= 0.8x DeepSpeed NVMe offload: 0.81x "
                    "(per round: 0.75, 0.87, 0.83; median 0.83x, 1 of 3 rounds within 0.8x)")
    rows["ds-nvme"]["failed_runs"] = ["timed out"]  # the rounds no longer pair
    line = next(g for g in compare.goals(rows) if g.split(" ", 1)[1].startswith("zinf NVMe"))
    assert line.endswith(": 0.81x")


def test_a_goal_shows_the_rows_cpu_per_step_beside_the_verdict(compare):
    """The CPU a step costs (every thread, every rank) rides on the goal line; with ``--repeat`` a row's
    is the median over its runs, not the middle run's; the verdict stays the step time's."""
    runs = [dict(_run(s, 1.0, "a"), cpu_per_step_s=c) for s, c in ((1.3, 2.0), (1.1, 2.4), (1.2, 2.2))]
    row = compare.combine_runs(runs)
    assert row["cpu_per_step_s"] == 2.2 and row["runs_cpu_per_step_s"] == [2.0, 2.4, 2.2]
    assert compare._cpu_cell(row) == "2.20" and compare._cpu_cell(_run(1.0, 1.0, "a")) == "-"
    rows = {"zinf-cpu-dp2": dict(_run(1.0, 40.0, "a"), cpu_per_step_s=1.8, dp=2, rss_sum_mib=900, adam="default"),
            "fsdp2-cpu": dict(_run(1.05, 1.0, "b"), cpu_per_step_s=2.4, dp=2, rss_sum_mib=1000, adam="default")}
    line = next(g for g in compare.goals(rows) if "FSDP2" in g)
    assert line == ("MISS zinf CPU offload (dp 2) <= 0.9x FSDP2 CPUOffloadPolicy: 0.95x; "
                    "CPU s a step 1.80 / 2.40 = 0.75x")


def test_each_goals_rows_run_side_by_side_with_per_size_timed_steps(compare, tmp_path, monkeypatch):
    """The run order puts a goal's two rows next to each other (the machine drifts for minutes, and a
    goal's ratio carries only the drift between its rows), whatever order --systems names them in;
    the table keeps its own order; each size gets its own default count of timed steps."""
    for _, a, b, _ in compare.GOALS:
        assert abs(compare.RUN_ORDER.index(a) - compare.RUN_ORDER.index(b)) == 1, (a, b)
    ran = []

    def fake_row(row, size, cfg, args, tmp, steps):
        ran.append((size, row, steps))
        return dict(_run(1.0, 1.0, "2026-01-01 00:00:00 UTC"), row=row, label=compare.LABELS[row], size=size,
                    dp=compare.ROWS[row][1], threads_per_rank=1, adam="default", global_batch=4, seq=8,
                    warmup=1, steps=steps, loadavg_before=[0.0], rss_sum_mib=1.0, rss_max_mib=1.0,
                    step_s=[1.0] * steps, wall_s=1.0, params=1000, run_at="2026-01-01 00:00:00 UTC")

    monkeypatch.setattr(compare, "run_row", fake_row)
    monkeypatch.setattr(compare, "machine", lambda root: {"cores": 2, "cpu": "x", "ram_gib": 1, "kernel": "k",
                                                          "versions": {}, "nvme_root": root,
                                                          "disk": {"device": "d", "fs": "f", "size_gib": 1,
                                                                   "rotational": 0}})
    argv = ["--sizes", "small,large", "--systems", "ds-nvme,zinf-cpu-dp2,fsdp2-cpu,zinf-nvme-dp2",
            "--interleave", "0", "--out", str(tmp_path), "--no-merge"]
    assert compare.main(argv) == 0
    assert ran == [(s, r, compare.DEFAULT_STEPS[s]) for s in ("small", "large")
                   for r in ("fsdp2-cpu", "zinf-cpu-dp2", "zinf-nvme-dp2", "ds-nvme")]
    md = (tmp_path / "compare.md").read_text()
    assert "tokens, 10 timed steps" in md and "tokens, 5 timed steps" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| FSDP2 + CPU") or ln.startswith("| zinf, CPU")]
    assert table[0].startswith("| FSDP2 + CPU")  # the table's order is ROWS', not the run order
    ran.clear()
    assert compare.main(argv[:-5] + ["--steps", "2", "--interleave", "0", "--out", str(tmp_path / "b")]) == 0
    assert {steps for _, _, steps in ran} == {2}
