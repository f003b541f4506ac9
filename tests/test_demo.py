"""The example behind ``make demo`` (examples/train_gpt.py), run as a user runs it: a subprocess.

Tiny settings (one block, width 32, a few steps) keep it to seconds; the defaults are what
``make demo`` runs. It checks what the demo promises: it exits 0, the loss falls on the real text,
the memory table is printed with NVMe traffic that really happened, the temporary NVMe folder is
gone afterwards, and ``--help`` lists the knobs (and no ``--trace`` unless the backend has one).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import zinf_compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_demo_trains_offloaded_and_reports():
    p = _run("--steps", "12", "--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "32",
             "--batch", "16", "--lr", "1e-2", "--corpus-bytes", "256KiB")
    out = p.stdout
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{out}\nstderr:\n{p.stderr[-4000:]}"
    # the loss fell: mean of the last steps well under the first ones (the first is ~ln 256)
    m = re.search(r"loss: ([\d.]+) -> ([\d.]+) \(mean of first \d+ steps ([\d.]+), of last \d+ ([\d.]+)", out)
    assert m, out
    first_loss, first_mean, last_mean = float(m.group(1)), float(m.group(3)), float(m.group(4))
    assert 5.0 < first_loss < 6.0, out
    assert last_mean < first_mean - 0.3, out
    assert len(re.findall(r"^step +\d+ +loss", out, re.M)) >= 3, out
    # the table, with NVMe traffic the swap engines counted
    for row in ("model states (fp32 params+grads+Adam m,v)", "peak full parameters gathered on the device",
                "peak RSS of this process", "NVMe bytes read", "NVMe bytes written"):
        assert row in out, (row, out)
    read = re.search(r"NVMe bytes read +(\d[\d.]* \S+)", out).group(1)
    written = re.search(r"NVMe bytes written +(\d[\d.]* \S+)", out).group(1)
    assert read != "0 B" and written != "0 B", out
    held = re.search(r"of which held in device memory +(\S+ \S+)", out).group(1)
    assert held == "0 B", out  # params and optimizer both on NVMe: no model state on the device
    assert "tiled matmuls:" in out, out  # the budget made tiling kick in
    # the temporary NVMe folder was removed
    folder = re.search(r"NVMe folder (\S+);", out).group(1)
    assert not os.path.exists(folder), folder
    assert "train:" in p.stderr and "step" in p.stderr, p.stderr[-2000:]  # the progress bar


def test_help_lists_the_knobs():
    p = _run("--help", timeout=120)
    assert p.returncode == 0, p.stderr
    for knob in ("--offload-params", "--offload-optimizer", "torchrun", "--tiles", "--device-memory-budget",
                 "--dump-dir", "--steps", "--layers", "--hidden", "--compiler"):
        assert knob in p.stdout, (knob, p.stdout)
    has_trace = "trace" in {f.name for f in dataclasses.fields(zinf_compile.Config)}
    assert ("--trace" in p.stdout) == has_trace, "--trace must exist exactly when the backend has a trace option"
