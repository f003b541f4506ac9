"""An accelerate training loop at dp = 2 under torchrun, zinf against eager DistributedDataParallel.

``accelerator.prepare(model)`` wraps the model in DistributedDataParallel whenever more than one
process runs, and its reducer would reduce zinf's gradients a second time (the first backward stops
with an error naming the wrapper). So the recipe leaves the model out of ``prepare`` and prepares the
optimizer and scheduler; the rest of the loop (``accumulate``, ``backward``, ``clip_grad_norm_``, the
scheduler) is accelerate's own (tests/workers/accelerate_dp.py).

Tolerance: both reduce each gradient as the mean of two half-batch values, so the gradients agree;
the clip coefficient may differ by a few ulps (zinf's per-shard norms summed in float64 against
eager's per-tensor fp32 norms), and the compiled forward may round a loss in its last bit. Every
clipped gradient has norm 0.5, so with momentum 0.9 and lr 0.1 the four updates add up to less than
0.18 in norm; a few ulps of relative difference in them is ~1e-8 absolute, and each parameter may
round to a neighbouring fp32 value once a step (``rtol=1e-6, atol=1e-7``, as the Lightning dp-2
test). A missed reduction would be off by far more: each rank's batches differ (asserted), so
each rank alone would step on its own gradient.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is installed by `make setup`")
sys.path.insert(0, os.path.dirname(__file__))
from _torchrun import run_modes  # noqa: E402

pytestmark = pytest.mark.parity


def test_accelerate_loop_at_dp2_matches_ddp_and_refuses_rank0s_optimizer_state(tmp_path):
    runs = run_modes("accelerate_dp.py", tmp_path)
    tol = dict(rtol=1e-6, atol=1e-7)
    for z, e in zip(runs["zinf"], runs["eager"]):
        assert len(z["losses"]) == len(e["losses"]) == 8 and len(z["norms"]) == len(e["norms"]) == 4
        assert min(e["norms"]) > 0.5  # clipping applies at every step
        torch.testing.assert_close(torch.tensor(z["losses"]), torch.tensor(e["losses"]), **tol)
        torch.testing.assert_close(torch.tensor(z["norms"]), torch.tensor(e["norms"]), **tol)
        assert z["lr"] == e["lr"]
        assert z["params"].keys() == e["params"].keys()
        for k, v in e["params"].items():
            torch.testing.assert_close(z["params"][k], v, **tol, msg=lambda m: f"{k}: {m}")
    # the ranks trained on different batches: a loop that skipped the reduction would show it here
    assert runs["eager"][0]["losses"] != runs["eager"][1]["losses"]
    # save_state wrote rank 0's optimizer shards; rank 1 refuses them, eager DDP's replicas load fine
    z0, z1 = runs["zinf"]
    assert z0["load_error"] is None and runs["eager"][1]["load_error"] is None
    assert "holds the shards of rank 0 of 2, but this is rank 1 of 2" in z1["load_error"]
    # zinf_compile.save / load given the prepared optimizer act on the optimizer it wraps, and lose
    # nothing. Before, load's conversion probed the wrapper, whose param_groups setter wrote the probe's
    # two (12,) tensors into the real optimizer, and changed the wrapper's class
    for z in (z0, z1):
        rt = z["roundtrip"]
        assert rt["groups_hold_the_model"] and rt["wrapper_class"] == "AcceleratedOptimizer", rt
        assert rt["state_equal"]
        for k, v in z["params"].items():
            assert torch.equal(rt["params"][k], v), k
