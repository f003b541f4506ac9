"""dp = 2 cannot drift apart: replicated gradients, buffers, clipping, uneven shards, one-rank evaluation.

Against one process training the same model on the global batch. Gradients at dp = 2 are the mean of
two half-batch means instead of one mean over 8 rows: each element is a sum of <= 8 products
reassociated, so its relative error is a few fp32 eps (1.2e-7) times the conditioning of the sum;
``rtol=1e-5, atol=1e-6`` over 3 SGD steps leaves that two orders of magnitude, while a rank that
skipped averaging, kept its own buffer or double-counted a replicated norm is off by > 1e-2.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from dp_loop import Outer, data, loss_of  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "workers", "dp_loop.py")


def torchrun(tmp_path, scenario: str, options: dict, steps: int = 3, extra: str = "0", env=None, timeout=240):
    out = tmp_path / "res"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), WORKER, str(out), scenario, json.dumps(options), str(steps), extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    results = [torch.load(f"{out}.{r}") if os.path.exists(f"{out}.{r}") else None for r in range(2)]
    return proc, results


def eager(steps: int = 3, clip: bool = True):
    torch.manual_seed(0)
    model = Outer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for x, y in data(steps):
        loss = loss_of(model.net(x), model.scale, y)
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        opt.step(); model.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


@pytest.mark.parametrize("options", [{"compiler": "eager"},
                                     {"compiler": "eager", "tiles": 3, "tile_threshold_bytes": 100}],
                         ids=["uneven_shards", "odd_tiles"])
def test_dp2_training_loop_matches_eager(tmp_path, options):
    proc, (r0, r1) = torchrun(tmp_path, "train", options)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses, norms, state = eager()
    tol = dict(rtol=1e-5, atol=1e-6)
    assert min(norms) > 0.05  # clipping applies at every step
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(losses), **tol)
    # the norm counts the replicated `scale` gradient once and every shard once, on both ranks
    torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(norms), **tol)
    assert r0["norms"] == r1["norms"]
    for k, v in state.items():
        torch.testing.assert_close(r0["state"][k], v, **tol, msg=lambda m: f"{k}: {m}")
    for r in (r0, r1):  # model.state_dict() is the full state on every rank; load_state_dict restores
        assert list(r["state_dict"]) == list(r["state"])
        for k, v in r["state"].items():
            assert torch.equal(r["state_dict"][k], v), k
    torch.manual_seed(0)
    for k, v in Outer().state_dict().items():
        if k != "net.shift":  # the buffer: rank 1 set its own before compiling
            assert torch.equal(r0["reloaded"][k], v) and torch.equal(r1["reloaded"][k], v), k
    torch.testing.assert_close(r1["shift"], torch.zeros(7), rtol=0, atol=0)  # rank 0's buffer won
    torch.testing.assert_close(r1["scale_rank"], r0["scale_rank"], rtol=0, atol=0)  # replicas agree
    # each rank's optimizer state names its shards; rank 0's state is refused on rank 1 and loses nothing
    assert (r0["shards_key"], r1["shards_key"]) == ({"rank": 0, "world": 2}, {"rank": 1, "world": 2})
    assert r0["rank0_load_error"] is None
    assert "holds the shards of rank 0 of 2, but this is rank 1 of 2" in r1["rank0_load_error"]
    assert "zinf_compile.save" in r1["rank0_load_error"]
    assert r0["opt_state_unchanged"] and r1["opt_state_unchanged"]


def test_dp2_plain_optimizer_averages_the_first_steps_replicated_gradient(tmp_path):
    """A plain torch optimizer becomes zinf's at its first step, after a backward that ran without the
    averaging hook: that step's replicated gradient is averaged then (with a warning naming what a clip
    before it saw), so the replicas agree and training matches eager. Before, each rank stepped
    `scale` with its own half-batch gradient and the replicas drifted apart (off by ~1e-2)."""
    proc, (r0, r1) = torchrun(tmp_path, "plain", {"compiler": "eager"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    _, _, state = eager(clip=False)
    for r in (r0, r1):
        assert len(r["warnings"]) == 1 and "zinf_compile.optim.sharded(optimizer)" in r["warnings"][0], r["warnings"]
    for k, v in state.items():
        torch.testing.assert_close(r0["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(r1["scale_rank"], r0["scale_rank"], rtol=0, atol=0)  # replicas agree


@pytest.mark.slow
def test_dp2_evaluating_on_one_rank_raises_instead_of_hanging(tmp_path):
    proc, (r0, r1) = torchrun(tmp_path, "eval_alone", {"compiler": "eager"}, steps=1, extra="25",
                              env={"ZINF_COLLECTIVE_TIMEOUT_S": "8"})
    assert r0 is not None, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert r0["error"] is not None and "evaluate on every rank" in r0["error"], r0
    assert r0["seconds"] < 60


@pytest.mark.slow
def test_dp2_state_dict_on_one_rank_raises_naming_it(tmp_path):
    """``model.state_dict()`` gathers every shard: on rank 0 alone, while rank 1 trains on, both wait
    for the other and stop after the collective timeout; rank 0's error says reading is collective."""
    proc, (r0, r1) = torchrun(tmp_path, "state_dict_alone", {"compiler": "eager"}, steps=1,
                              env={"ZINF_COLLECTIVE_TIMEOUT_S": "8"})
    for r in (r0, r1):
        assert r is not None, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert r["error"] is not None and r["seconds"] < 60, r
    assert "call model.state_dict()" in r0["error"] and "on every rank" in r0["error"], r0


def test_dp2_ranks_in_different_graph_modes_raise(tmp_path):
    proc, (r0, r1) = torchrun(tmp_path, "eval_vs_train", {"compiler": "eager"}, steps=1)
    for r in (r0, r1):
        assert r is not None, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert r["error"] is not None and "different compiled graphs" in r["error"], r


def test_dp2_grad_scaler_skips_on_every_rank_when_one_shard_overflows(tmp_path):
    # found_inf is max-reduced over dp: rank 0's shards are finite, rank 1's is not, and both skip step 1
    proc, (r0, r1) = torchrun(tmp_path, "scaler", {"compiler": "eager"}, steps=3)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert r0["norms"] == r1["norms"] == [512.0, 512.0, 512.0]  # backed off once, then stepped
    for k, v in r0["state"].items():
        torch.testing.assert_close(r1["state"][k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    torch.manual_seed(0)
    init = Outer().state_dict()
    assert not torch.equal(r0["state"]["net.fc1.weight"], init["net.fc1.weight"])  # the later steps applied
