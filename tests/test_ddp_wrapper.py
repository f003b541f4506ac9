"""A DistributedDataParallel wrapper around a zinf model gets an error naming it and the fix.

Not a parity test (nothing trains), so it stays out of the ATEN_CPU_CAPABILITY=default rerun that
test_dp.py's module mark would put it in.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _torchrun import torchrun as _torchrun  # noqa: E402


@pytest.mark.parametrize("order", ["ddp_then_compile", "compile_then_ddp"])
def test_a_ddp_wrapper_gets_an_error_naming_it_and_the_fix(order):
    """zinf reduces gradients itself: DDP around it must fail clearly, not train on doubled reductions."""
    proc = _torchrun("ddp_wrapped.py", order, timeout=240)
    assert proc.returncode != 0
    assert "DistributedDataParallel (or FSDP) wrapper around a zinf model" in proc.stderr, proc.stderr[-4000:]
    assert "remove the wrapper" in proc.stderr


@pytest.mark.slow
def test_the_hf_trainer_at_dp2_gets_the_error_naming_it(tmp_path):
    """accelerate wraps the model in DDP once two processes run: the plain Trainer at dp 2 must stop
    with the error that names it and what to use instead, ZinfTrainer (about 40 s)."""
    pytest.importorskip("transformers", reason="transformers is installed by `make setup`")
    proc = _torchrun("hf_trainer_dp.py", str(tmp_path), timeout=300)
    assert proc.returncode != 0
    assert "DistributedDataParallel (or FSDP) wrapper around a zinf model" in proc.stderr, proc.stderr[-4000:]
    assert "The Hugging Face Trainer (through accelerate) wraps the model" in proc.stderr
    assert "use zinf_compile.hf.ZinfTrainer" in proc.stderr
