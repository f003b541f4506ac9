"""Hand-checked values for the paper's analytic model and the ``zinf plan`` CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zinf_compile.analytic import DoesNotFitError, Hardware, TransformerSpec, analyze, check_fits
from zinf_compile.cli import build_parser, main, parse_quantity

GiB = 1 << 30
MiB = 1 << 20
TiB = 1 << 40

KEYS = {
    "fits", "params", "model_state_bytes", "working_memory_bytes", "activation_working_memory_bytes",
    "activation_checkpoint_bytes", "flops_per_iteration", "ait_param_grad", "ait_optimizer",
    "ait_activation_checkpoint", "efficiency", "placement",
}
# A small model: params 25,165,824 -> optimizer 384 MiB, params+grads 96 MiB,
# checkpoints 8 MiB, activation working memory 64 MiB, largest linear 16 MiB.
SMALL = TransformerSpec(layers=2, hidden=1024, heads=16, seq=512, batch=4)


def small_hw(device: int, cpu: int = TiB, nvme: int = 10 * TiB) -> Hardware:
    return Hardware(device_memory_bytes=device, cpu_memory_bytes=cpu, nvme_bytes=nvme,
                    slow_bandwidth_bytes_per_s=10e9, peak_flops_per_s=70e12)


def test_small_model_hand_computed() -> None:
    r = analyze(SMALL, small_hw(GiB))
    assert set(r) == KEYS
    assert r["params"] == 25_165_824                      # 12 * 2 * 1024**2
    assert r["model_state_bytes"] == 503_316_480          # 240 * 2 * 1024**2
    assert r["working_memory_bytes"] == 16_777_216        # 16 * 1024**2
    assert r["activation_working_memory_bytes"] == 67_108_864  # 4*512*1*(16*1024 + 2*16*512)
    assert r["activation_checkpoint_bytes"] == 8_388_608  # 2*4*512*1024*2
    assert r["flops_per_iteration"] == 412_316_860_416    # 8*4*512*25,165,824
    assert (r["ait_param_grad"], r["ait_optimizer"], r["ait_activation_checkpoint"]) == (2048, 512, 24576)
    for key in ("params", "model_state_bytes", "working_memory_bytes", "activation_working_memory_bytes",
                "activation_checkpoint_bytes", "flops_per_iteration"):
        assert type(r[key]) is int, key
    # ait*bw / (ait*bw + peak) with bw = 10 GB/s, peak = 70 TFLOP/s
    assert r["efficiency"] == {
        "param_grad": pytest.approx(20.48 / 90.48),
        "optimizer": pytest.approx(5.12 / 75.12),
        "activation_checkpoint": pytest.approx(245.76 / 315.76),
    }
    assert r["fits"] is True and r["placement"]["recommendation"].startswith("fits: ")
    assert set(r["placement"]) == {"params", "optimizer", "activation_checkpoints", "tiles", "reason",
                                   "recommendation"}
    assert set(r["placement"]["reason"]) == {"params", "optimizer", "activation_checkpoints", "tiles"}


def test_ceil_division_for_tiles_and_ckpt_interval() -> None:
    spec = TransformerSpec(layers=2, hidden=1024, heads=16, seq=512, batch=4, ckpt_interval=3, tiles=3)
    r = analyze(spec, small_hw(GiB))
    assert r["working_memory_bytes"] == 5_592_406          # ceil(16,777,216 / 3)
    assert r["activation_checkpoint_bytes"] == 2_796_203   # ceil(8,388,608 / 3)
    assert r["activation_working_memory_bytes"] == 3 * 67_108_864
    assert r["ait_activation_checkpoint"] == 24 * 1024 * 3
    assert r["placement"]["tiles"] == 4  # smallest power of two >= 3


def test_half_efficiency_when_ait_times_bandwidth_equals_peak() -> None:
    spec = TransformerSpec(layers=1, hidden=1024, heads=16, seq=1750, batch=4)  # seq*bsz = 7000
    r = analyze(spec, small_hw(GiB))
    assert r["efficiency"]["param_grad"] == pytest.approx(0.5)  # 7000 * 10e9 == 70e12
    assert r["efficiency"]["optimizer"] == pytest.approx(0.2)   # 1750e10 / (1750e10 + 70e12)


def test_paper_64k_hidden_working_memory_and_tiles() -> None:
    spec = TransformerSpec(layers=1, hidden=65536, heads=128, seq=1024, batch=1)
    r = analyze(spec)  # default: 32 GiB V100
    assert r["working_memory_bytes"] == 68_719_476_736 == 64 * GiB
    # 16 tiles bring it to 4 GiB, 1/8 of a 32 GiB device: the recommendation.
    assert r["placement"]["tiles"] == 16
    tiled = analyze(TransformerSpec(layers=1, hidden=65536, heads=128, seq=1024, batch=1, tiles=16))
    assert tiled["working_memory_bytes"] == 4 * GiB
    # A device with half the memory needs twice the tiles.
    assert analyze(spec, Hardware(device_memory_bytes=16 * GiB))["placement"]["tiles"] == 32


def test_paper_trillion_parameter_configs() -> None:
    # nl=128, hd=25K: 1.01 T params; 20 B/param = 18.31 TiB of model states.
    r = analyze(TransformerSpec(layers=128, hidden=25600, heads=160, seq=1024, batch=1, dp=512))
    assert r["params"] == 12 * 128 * 25600**2 == 1_006_632_960_000
    assert r["model_state_bytes"] == 20 * r["params"]
    assert round(r["model_state_bytes"] / TiB, 2) == 18.31
    # nl=195, hd=64K: 10.05 T params, 182.81 TiB.
    r = analyze(TransformerSpec(layers=195, hidden=65536, heads=128, seq=1024, batch=1, dp=4096),
                Hardware(cpu_memory_bytes=256 * 3 * TiB // 2, nvme_bytes=256 * 28 * 10**12))
    assert r["params"] == 10_050_223_472_640
    assert round(r["model_state_bytes"] / TiB, 2) == 182.81


def test_placement_moves_off_device_as_memory_shrinks() -> None:
    def where(device: int, **kw: int) -> tuple[str, str, str]:
        p = analyze(SMALL, small_hw(device, **kw))["placement"]
        return p["params"], p["optimizer"], p["activation_checkpoints"]

    # budget = device - 64 MiB activations - 16 MiB largest linear; needs 488 MiB.
    assert where(GiB) == ("device", "device", "device")
    assert where(256 * MiB) == ("device", "cpu", "device")        # 176 MiB left: evict optimizer
    assert where(128 * MiB) == ("cpu", "cpu", "device")           # 48 MiB left: only checkpoints stay
    assert where(128 * MiB, cpu=200 * MiB) == ("cpu", "nvme", "device")  # 384 MiB optimizer spills
    # no room anywhere: checkpoints still stay on the device, the model states are not placed
    assert where(128 * MiB, cpu=0, nvme=0) == (None, None, "device")
    r = analyze(SMALL, small_hw(128 * MiB, cpu=0, nvme=0))
    assert r["fits"] is False and "--nvme" in r["placement"]["recommendation"]
    with pytest.raises(DoesNotFitError, match="--nvme"):
        check_fits(r)
    r = analyze(SMALL, small_hw(64 * MiB))  # activation working memory alone fills the device
    assert r["fits"] is False and "--batch" in r["placement"]["recommendation"]
    assert where(64 * MiB) == (None, None, None)
    with pytest.raises(DoesNotFitError, match="--batch"):
        check_fits(r)


def test_data_parallel_partitioning_keeps_states_on_device() -> None:
    spec = TransformerSpec(layers=2, hidden=1024, heads=16, seq=512, batch=4, dp=4)
    p = analyze(spec, small_hw(256 * MiB))["placement"]  # 120 MiB share + 8 MiB <= 176 MiB
    assert (p["params"], p["optimizer"], p["activation_checkpoints"]) == ("device",) * 3
    # CPU memory is shared by the group: the optimizer's 4 x 96 MiB do not fit in 300 MiB.
    p = analyze(spec, small_hw(90 * MiB, cpu=300 * MiB))["placement"]
    assert p["optimizer"] == "nvme" and p["params"] == "cpu"


@pytest.mark.parametrize("field,flag", [("layers", "--layers"), ("hidden", "--hidden"), ("heads", "--heads"),
                                        ("seq", "--seq"), ("batch", "--batch"),
                                        ("ckpt_interval", "--ckpt-interval"), ("dp", "--dp"),
                                        ("tiles", "--tiles")])
def test_spec_rejects_non_positive(field: str, flag: str) -> None:
    kw = dict(layers=2, hidden=1024, heads=16, seq=512, batch=4)
    with pytest.raises(ValueError, match=f"{flag} must be positive.*e.g. {flag}"):
        TransformerSpec(**{**kw, field: 0})
    with pytest.raises(ValueError, match=f"{flag} must be an integer"):
        TransformerSpec(**{**kw, field: 2.5})


def test_hardware_validation() -> None:
    with pytest.raises(ValueError, match="--device-memory must be positive"):
        Hardware(device_memory_bytes=0)
    with pytest.raises(ValueError, match="--peak-flops"):
        Hardware(peak_flops_per_s=-1.0)
    with pytest.raises(ValueError, match="--bandwidth must be finite"):
        Hardware(slow_bandwidth_bytes_per_s=float("inf"))
    assert Hardware(nvme_bytes=0).nvme_bytes == 0  # "no NVMe" is a real configuration


@pytest.mark.parametrize("text,unit,rate,value", [
    ("32GB", "B", False, 32e9), ("32GiB", "B", False, 32 * GiB), ("1.5TB", "B", False, 1.5e12),
    ("1.5TiB", "B", False, 1.5 * TiB), ("4096", "B", False, 4096), ("2k", "B", False, 2000),
    ("25GB/s", "B", True, 25e9), ("70T", "FLOPS", True, 70e12), ("70TFLOPS", "FLOPS", True, 70e12),
    ("7e13", "FLOPS", False, 7e13),
])
def test_parse_quantity(text: str, unit: str, rate: bool, value: float) -> None:
    assert parse_quantity(text, unit, rate=rate) == value


@pytest.mark.parametrize("text", ["GB", "32XB", "10iB", "25GB/s", "1.5 parsecs"])
def test_parse_quantity_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="e.g. 32GB"):
        parse_quantity(text)


PLAN = ["plan", "--layers", "2", "--hidden", "1024", "--heads", "16", "--seq", "512", "--batch", "4",
        "--device-memory", "256MiB", "--cpu-memory", "1TiB", "--nvme", "10TiB",
        "--bandwidth", "10GB/s", "--peak-flops", "70T"]


def test_cli_json_subprocess_equals_analyze() -> None:
    proc = subprocess.run([sys.executable, "-m", "zinf_compile.cli", *PLAN, "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == analyze(SMALL, small_hw(256 * MiB))


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "place optimizer" in out and "cpu" in out and "recommended tiles" in out
    assert "MiB" in out and "TiB" in out and "TFLOP/s" in out and "why:" in out


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    bad = [*PLAN]
    bad[bad.index("--layers") + 1] = "0"
    assert main(bad) == 2
    assert "--layers must be positive" in capsys.readouterr().err
    assert main([*PLAN[:-2], "--peak-flops", "lots"]) == 2
    assert "--peak-flops" in capsys.readouterr().err
    assert main([*PLAN, "--cpu-memory", "0", "--nvme", "0", "--device-memory", "128MiB"]) == 1
    assert "does not fit" in capsys.readouterr().err
    assert main([]) == 2  # a subcommand is required


# does not fit: no CPU memory, no NVMe; 128 MiB leave 48 MiB for 480 MiB of model states
NOFIT = [*PLAN, "--cpu-memory", "0", "--nvme", "0", "--device-memory", "128MiB"]
NOFIT_HW = small_hw(128 * MiB, cpu=0, nvme=0)


def test_cli_table_when_model_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(NOFIT) == 1  # the exit status still says "does not fit"
    captured = capsys.readouterr()
    want = analyze(SMALL, NOFIT_HW)
    out = captured.out
    for label in ("parameters", "model states", "working memory", "activation working memory",
                  "activation checkpoints", "FLOPs per iteration", "AIT param/grad", "AIT optimizer",
                  "AIT activation checkpoint", "place params", "place optimizer", "recommended tiles", "why:"):
        assert label in out, label
    assert f"({want['params']:,})" in out and "480.00 MiB" in out and "412 GFLOPs" in out
    eff = want["efficiency"]
    assert f"{eff['param_grad']:.1%}" == "22.6%"  # 2048 * 10 GB/s / (2048 * 10 GB/s + 70 TFLOP/s)
    assert f"efficiency {eff['param_grad']:.1%}" in out
    assert f"efficiency {eff['optimizer']:.1%}" in out and f"efficiency {eff['activation_checkpoint']:.1%}" in out
    assert [line.split() for line in out.splitlines() if line.strip().startswith("fits ")] == [["fits", "NO"]]
    assert f"recommendation: {want['placement']['recommendation']}" in out
    assert "not placed" in out and "--nvme" in want["placement"]["recommendation"]
    assert "does not fit" in captured.err and "--nvme" in captured.err


def test_cli_json_when_model_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*NOFIT, "--json"]) == 1
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    assert got == analyze(SMALL, NOFIT_HW)
    assert set(got) == KEYS and got["fits"] is False
    assert got["params"] == 25_165_824 and got["model_state_bytes"] == 503_316_480  # every figure still there
    assert got["placement"]["recommendation"].startswith("does not fit: ")
    assert "--nvme" in got["placement"]["recommendation"]
    assert got["placement"]["activation_checkpoints"] == "device"
    assert got["placement"]["params"] is None and got["placement"]["optimizer"] is None


def test_parser_has_plan_subcommand() -> None:
    args = build_parser().parse_args(PLAN)
    assert args.command == "plan" and args.device_memory == 256 * MiB and args.peak_flops == 70e12
