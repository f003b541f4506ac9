"""dp = 2 on gloo (two processes under torchrun) against single-process eager on the global batch.

Each rank sums its half of the batch and the reduce-scatter adds the halves (mean over dp): the
gradient's reduction runs in another order than eager's. So the first step's gradients are held to
the fp32 summation bound (tests/conftest.py) and the parameters compared after SGD steps; Adam
would turn that reordering into ±lr updates wherever a gradient is near zero.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from zinf_compile.models import GPT, GPTConfig, make_batch
from workers.dp_train import SGD

from conftest import RTOL, ATOL, Run, assert_grads_within_reduction_bound, eager_grads

pytestmark = pytest.mark.parity

HERE = os.path.dirname(__file__)
CFG = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4, init_std=None)


def run_dp(tmp_path, options, steps=3, global_batch=8, nproc=2, cfg=CFG, timeout=240):
    """torchrun the worker; a hang fails at ``timeout`` (gloo's own timeout is 120 s) instead of blocking CI."""
    out = tmp_path / "dp_result.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.join(HERE, "workers", "dp_train.py"),
           str(out), json.dumps(options), str(steps), str(global_batch), json.dumps(cfg)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def eager_reference(steps=3, global_batch=8, cfg=CFG):
    """Single-process eager training on the global batch; also the first step's gradients."""
    c = GPTConfig(**cfg)
    torch.manual_seed(0)
    model = GPT(c)
    init = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    losses, grads = [], {}
    for step in range(steps):
        x, y = make_batch(c, global_batch, seed=step)
        loss = model(x, y)
        loss.backward()
        if step == 0:
            grads = eager_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict(), grads, init, [make_batch(c, global_batch, seed=0)]


def assert_matches_eager(res):
    losses, state, grads, init, first = eager_reference()
    run = Run(losses, res["losses"], None, None, init, first, 1, grads, res["grads"])
    assert_grads_within_reduction_bound(run)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), rtol=RTOL, atol=ATOL)
    for k, v in state.items():
        torch.testing.assert_close(res["state"][k], v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
    # the worker's evaluation under torch.inference_mode, after the training steps
    model = GPT(GPTConfig(**CFG))
    model.load_state_dict(state)
    with torch.no_grad():
        want = model(*make_batch(GPTConfig(**CFG), 8, seed=1000)).item()
    torch.testing.assert_close(torch.tensor(res["eval_loss"]), torch.tensor(want), rtol=RTOL, atol=ATOL)


def test_gpt_dp2_matches_single_process_eager(tmp_path):
    res = run_dp(tmp_path, {"compiler": "eager"})
    assert_matches_eager(res)
    # each rank's store holds half of every parameter (padding to an even split included)
    total = res["total_param_bytes"]
    for b in res["shard_bytes"]:
        assert total / 2 <= b <= total / 2 + 4 * 64, (b, total)
    counts = res["counts"]
    assert counts.get("forward:zinf.wait_gather.default", 0) > 0, counts
    assert counts.get("backward:zinf.wait_gather.default", 0) > 0, counts
    assert counts.get("backward:zinf.wait_reduce.default", 0) > 0, counts  # each gradient waits for its own
    # bucket_bytes=None: this model's small parameters share collectives (test_schedule: bitwise as unbucketed)
    assert counts.get("forward:zinf.gather_bucket.default", 0) > 0, counts
    assert counts.get("backward:zinf.reduce_bucket.default", 0) > 0, counts
    assert counts["forward:zinf.release.default"] == counts["forward:zinf.wait_gather.default"], counts
    assert counts["backward:zinf.release.default"] == counts["backward:zinf.wait_gather.default"], counts
    # the shards live in the compute device's memory (here the CPU): every fetch reads its slot in place
    # (no upload copy), and the collectives still never read a slot (strict comm is on in the suite)
    fetches = counts["forward:zinf.wait_upload.default"] + counts["backward:zinf.wait_upload.default"]
    assert res["transfers"].get("in_place", 0) == 3 * fetches, (res["transfers"], fetches)  # run_dp's 3 steps
    # the buckets' flat buffers are the model pool's, reused: a fourth step allocates none of them
    first_steps, fourth = res["pool_allocations"]
    assert first_steps > 0 and fourth == 0, res["pool_allocations"]


def test_gpt_dp2_with_tiling_matches_single_process_eager(tmp_path):
    dump = tmp_path / "dump"
    res = run_dp(tmp_path, {"compiler": "eager", "tiles": 3, "tile_threshold_bytes": 10_000, "dump_dir": str(dump)})
    assert_matches_eager(res)
    # dump_dir at dp 2: one folder per rank (a shared one had both ranks rewrite one index.json, and a
    # rank that read it half-written fell back alone); `zinf inspect` on the root names them
    from zinf_compile import inspect as zinspect

    assert sorted(os.listdir(dump)) == ["rank0", "rank1"]
    for r in ("rank0", "rank1"):
        graphs = zinspect.load(str(dump / r)).graphs
        assert graphs and all(g.snapshots for g in graphs), r
    with pytest.raises(ValueError, match="one folder per rank"):
        zinspect.load(str(dump))
    counts = res["counts"]
    # every tile is all-gathered and reduce-scattered on its own: 24 parameters, of which qkv, fc and
    # out (3 per layer) become 3 tiles each (each waited for alone, whether its collective is bucketed)
    tiled = 3 * CFG["layers"]
    assert counts["forward:zinf.wait_gather.default"] == 24 - tiled + 3 * tiled
    assert counts["backward:zinf.wait_reduce.default"] == 24 - tiled + 3 * tiled


def test_gpt_dp2_nvme_params_and_optimizer(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    res = run_dp(tmp_path, {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme",
                            "nvme_path": str(nvme), "optimizer_sub_group_bytes": 1 << 16,
                            "nvme_min_shard_bytes": 0})  # every parameter on NVMe, norms and biases too
    assert_matches_eager(res)
    total = res["total_param_bytes"]
    for b in res["shard_bytes"]:  # half of every parameter per rank, on NVMe
        assert total / 2 <= b <= total / 2 + 4 * 64, (b, total)
    assert not any(nvme.iterdir()), "per-rank swap folders are removed at exit"
