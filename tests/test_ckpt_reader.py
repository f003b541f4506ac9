"""The checkpoint reader's direct path (``zinf_compile/_ckpt_reader.py``) against DCP's own reader.

Why: ``FastReader`` locates a tensor's bytes inside the ``torch.save`` record DCP wrote and reads them
straight into the destination. A wrong offset would load shifted or foreign bytes, so every check is
element-for-element equality with the saved values and with ``FileSystemReader`` on the same files, and
each checks that the direct path really fired (or really stepped aside) by its counter.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from zinf_compile._ckpt_layout import LoadPlanner, Target
from zinf_compile._ckpt_reader import FastReader
from zinf_compile.checkpoint import _root_oserror


@pytest.fixture
def saved(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "flat": torch.randn(1000, generator=g),
        "ints": torch.arange(77, dtype=torch.int64),
        "mat": torch.randn(16, 8, generator=g).t(),  # 2-D and transposed: DCP's own path
        "half": torch.randn(33, generator=g).to(torch.bfloat16),
    }
    path = str(tmp_path / "ck")
    dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=True), no_dist=True)
    return path, state


def _load(reader, state):
    dest = {k: torch.full(v.shape, -7.0).to(v.dtype) for k, v in state.items()}
    dcp.load(dest, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    return dest


def test_direct_reads_equal_the_saved_tensors_and_dcps_reader(saved):
    path, state = saved
    fast = FastReader(path)
    got, ref = _load(fast, state), _load(FileSystemReader(path), state)
    for k in state:
        assert torch.equal(got[k], state[k]), k
        assert torch.equal(got[k], ref[k]), k
    assert fast.direct_items == 3  # flat, ints, half; "mat" is 2-D and went through DCP's path


def test_a_range_inside_an_entry_lands_where_it_belongs(saved):
    path, state = saved
    dest = torch.full((200,), -7.0)
    fast = FastReader(path)
    dcp.load({}, storage_reader=fast, planner=LoadPlanner([Target("flat", 1000, 300, dest)]), no_dist=True)
    assert torch.equal(dest, state["flat"][300:500])
    assert fast.direct_items == 1


def test_a_truncated_file_is_an_error_naming_it(saved):
    path, state = saved
    (data,) = [f for f in os.listdir(path) if f.endswith(".distcp")]
    full = os.path.join(path, data)
    with open(full, "r+b") as f:
        f.truncate(os.path.getsize(full) // 2)
    with pytest.raises(CheckpointException) as err:
        _load(FastReader(path), state)
    root, rank = _root_oserror(err.value)  # DCP wraps it per rank
    assert root.errno == errno.EIO and root.filename == full and "truncated" in str(root)


def test_zinf_load_of_a_truncated_checkpoint_names_the_file(tmp_path):
    import zinf_compile

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    cmodel = torch.compile(model, backend="zinf", options={"offload_params": "cpu", "compiler": "eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cmodel(torch.randn(4, 32)).sum().backward()
    opt.step()
    ck = str(tmp_path / "ck")
    zinf_compile.save(ck, cmodel, opt)
    (data,) = [f for f in os.listdir(ck) if f.endswith(".distcp")]
    with open(os.path.join(ck, data), "r+b") as f:
        f.truncate(100)
    with pytest.raises(zinf_compile.CheckpointError, match=rf"{data}.*truncated") as err:
        zinf_compile.load(ck, cmodel, opt)
    assert err.value.errno == errno.EIO
