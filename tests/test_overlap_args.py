"""``benchmarks/overlap.py`` passes every option that shapes a row on to the row's subprocess.

Why: each row runs in a fresh process of the same script (``--row NAME``), so an option the parent
parses but does not forward is silently dropped. ``--prefetch-depths`` was: every run that asked for
other depths measured the defaults and labelled them as asked. Here each row's command line is
parsed back and must give the same zinf options as the parent's arguments.
"""

from __future__ import annotations

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
