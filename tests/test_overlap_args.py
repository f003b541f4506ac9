"""``benchmarks/overlap.py`` passes every option that shapes a row on to the row's subprocess.

Why: each row runs in a fresh process of the same script (``--row NAME``), so an option the parent
parses but does not forward is silently dropped. ``--prefetch-depths`` was: every run that asked for
other depths measured the defaults and labelled them as asked. Here each row's command line is
parsed back and must give the same zinf options as the parent's arguments.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import overlap  # noqa: E402


@pytest.mark.parametrize("argv", [
    [],
    ["--prefetch-depths", "8,2,1", "--reduce-depths", "1,1"],
    ["--prefetch-depths", "16,4,1", "--optimizer-prefetch", "off", "--read-cache-bytes", "0"],
    ["--trace", "/tmp/t.json", "--batch", "6", "--threads", "1", "--compiler", "eager"],
    ["--sub-group-bytes", str(512 << 20), "--threads", "1"],
])
@pytest.mark.parametrize("row", overlap.MODEL_ROWS)
def test_a_row_process_gets_the_options_its_parent_was_given(argv, row):
    parent = overlap.build_parser().parse_args(argv)
    parent.steps, parent.warmup = 5, 1  # main() fills these in before spawning
    cmd = overlap.row_command(parent, row, "/tmp/row.json", [])
    assert cmd[1] == os.path.abspath(overlap.__file__)
    child = overlap.build_parser().parse_args(cmd[2:])
    assert child.row == row
    assert overlap.row_options(row, child, "/nvme") == overlap.row_options(row, parent, "/nvme")
    assert overlap.model_dims(child) == overlap.model_dims(parent)
    assert (child.threads, child.device, child.steps, child.warmup) == (parent.threads, parent.device, 5, 1)


def test_balanced_batch_is_where_compute_meets_transfer():
    # compute grows with the batch, transfer does not: 2 x (1.2 / 0.4) = 6
    assert overlap.balanced_batch(2, compute_s=0.4, transfer_s=1.2, max_batch=256) == 6
    assert overlap.balanced_batch(2, compute_s=1.8, transfer_s=1.2, max_batch=256) == 1  # 1.33 rounds to 1
    assert overlap.balanced_batch(2, compute_s=0.01, transfer_s=2.0, max_batch=64) == 64  # capped
    assert overlap.balanced_batch(1, compute_s=5.0, transfer_s=0.1, max_batch=64) == 1  # never below 1


def test_balance_runs_the_rows_at_the_calibrated_batch(monkeypatch, tmp_path):
    """``--balance``: memory, serial and transfer at --batch first, then every asked row at the batch
    where the memory row's compute equals the transfer; the report names both batches."""
    calls = []

    def fake_spawn(args, row, extra, tmp):
        calls.append((row, overlap.model_dims(args)["batch"], args.steps, tmp))
        base = {"median_step_s": 0.0, "min_step_s": 0.0, "first_step_s": 0.0, "peak_rss_mib": 1.0,
                "foreign_cpu": 0.0, "load1_start": 0.0, "params": 1}
        if row == "transfer":
            return dict(base, median_step_s=1.2, swap_config={"block_size": 1 << 20, "queue_depth": 8}, files=1,
                        read_bytes=1, write_bytes=1, bytes_source="x", direct_io=True, page_cache_dropped=True,
                        block_device="vda", runs=[{}], median_run={"write_s": 0.5, "write_gbps": 1.0, "read_s": 0.7,
                                                                   "read_gbps": 1.0, "device_read_share": 1.0,
                                                                   "device_written_share": 1.0})
        nvme = {"bytes_read_per_step": 1, "bytes_written_per_step": 1, "reads_per_step": 1, "writes_per_step": 1,
                "peak_disk_bytes": 1, "direct_io": True}
        step = 0.4 * overlap.model_dims(args)["batch"] / 2 if row == "memory" else 2.0
        options = {"offload_params": "none" if row == "memory" else "nvme", "offload_optimizer": "nvme"}
        return dict(base, median_step_s=step, options=options, **({} if row == "memory" else {"nvme": nvme}))

    monkeypatch.setattr(overlap, "spawn", fake_spawn)
    assert overlap.main(["--balance", "--rows", "serial,scheduled,memory,transfer", "--steps", "3",
                         "--out", str(tmp_path), "--name", "b"]) == 0
    assert [(r, b, s) for r, b, s, _ in calls] == [
        ("memory", 2, 2), ("serial", 2, 2), ("transfer", 2, 2),  # calibration: --batch, 2 timed steps
        ("memory", 6, 2),  # 2 x 1.2 / 0.4 = 6, timed again there (linear here: stays 6)
        ("serial", 6, 3), ("scheduled", 6, 3), ("memory", 6, 3), ("transfer", 6, 3)]
    assert len({tmp for *_, tmp in calls[:4]} | {calls[4][3]}) == 3  # calibration rows write their files apart
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["meta"]["calibration"]["balanced_batch"] == 6 and saved["model"]["batch"] == 6
    assert "at batch 6 memory took 1.200 s, so compute equals transfer near batch 6" in (tmp_path / "b.md").read_text()


def test_balance_corrects_a_guess_where_compute_is_not_linear(monkeypatch, tmp_path):
    """On a GPU at a small batch per-operator overhead dominates: timing the guess corrects it."""
    steps = {2: 0.1, 24: 0.6}  # 24 costs 6x batch 2, not 12x: the corrected guess is 24 x 1.2 / 0.6 = 48
    seen = []

    def fake_spawn(args, row, extra, tmp):
        b = overlap.model_dims(args)["batch"]
        seen.append((row, b))
        if row == "transfer":
            return {"median_step_s": 1.2}
        return {"median_step_s": steps[b] if row == "memory" else 2.0, "nvme": {}}

    monkeypatch.setattr(overlap, "spawn", fake_spawn)
    args = overlap.build_parser().parse_args(["--balance"])
    args.steps, args.warmup = 3, 1
    cal = overlap.calibrate(args, str(tmp_path))
    assert seen == [("memory", 2), ("serial", 2), ("transfer", 2), ("memory", 24)]
    assert cal["refined"] == [{"batch": 24, "memory_s": 0.6}] and cal["balanced_batch"] == 48


def test_max_batch_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as ei:
        overlap.main(["--balance", "--max-batch", "0"])
    assert ei.value.code == 2 and "--max-batch must be >= 1" in capsys.readouterr().err
