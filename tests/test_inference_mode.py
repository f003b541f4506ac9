"""Evaluation under ``torch.inference_mode()`` between training steps, as real loops do it.

Lightning runs its validation loop, and the checkpoint callbacks at its end, under
``torch.inference_mode()``; ``model.generate`` users wrap it the same way. Inference mode is
thread-local and marks every tensor made under it, and an inference tensor refuses in-place updates
outside inference mode. zinf's runtime makes buffers that outlive a call (pooled NVMe reads, the
read cache, shard copies) and writes into them from its lane and IO threads, so before the fix an
NVMe-offloaded forward under inference mode raised, and a state_dict() read under it left cached
inference tensors that made the next optimizer step raise.

Each test trains a zinf model and an eager one side by side, evaluating, reading ``state_dict()``
and the optimizer's state dict under inference mode between the steps; dp = 1 with
``compiler="eager"`` runs eager's ops in eager's order, so every number must be equal.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch

pytestmark = pytest.mark.parity

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)


def _options(tier: str, tmp_path, compiler: str = "eager") -> dict:
    opts = {"compiler": compiler, "offload_params": tier, "offload_optimizer": tier}
    if tier == "nvme":
        opts["nvme_path"] = str(tmp_path)
    return opts


def _train_and_evaluate(options: dict, steps: int = 3):
    """Per step: train on a batch, then under inference mode evaluate a shorter batch and read both
    state dicts. Returns (train losses, eval losses, model state, optimizer state) for each side."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    cmodel = torch.compile(model, backend="zinf", options=options)
    sides = [(ref, ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)),
             (model, cmodel, zinf_compile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))]
    out = []
    for module, run, opt in sides:
        train, evals, sd, osd = [], [], {}, {}
        for step in range(steps):
            x, y = make_batch(CFG, 4, seed=step)
            loss = run(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            train.append(loss.item())
            ex, ey = make_batch(CFG, 2, seed=100 + step)
            with torch.inference_mode():
                e = run(ex[:, :8].contiguous(), ey[:, :8].contiguous())
                assert e.is_inference()
                evals.append(e.item())
                sd = {k: v.clone() for k, v in module.state_dict().items()}
                osd = opt.state_dict()
        out.append((train, evals, sd, osd))
    return out


def _assert_equal_runs(ref, got, exact: bool = True) -> None:
    (rt, re_, rsd, rosd), (zt, ze, zsd, zosd) = ref, got
    close = (lambda a, b: torch.equal(a, b)) if exact else (
        lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    assert close(torch.tensor(zt), torch.tensor(rt)), (zt, rt)
    assert close(torch.tensor(ze), torch.tensor(re_)), (ze, re_)
    assert zsd.keys() == rsd.keys()
    for k in rsd:
        assert close(zsd[k], rsd[k]), k
    rbufs = [s["momentum_buffer"] for s in rosd["state"].values()]
    zbufs = [s["momentum_buffer"] for s in zosd["state"].values()]
    assert len(rbufs) == len(zbufs) > 0
    for a, b in zip(zbufs, rbufs):  # zinf's state is the flat shard: the whole parameter at dp 1
        assert close(a.reshape(b.shape), b)


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_inference_mode_evaluation_and_state_dicts_between_steps_match_eager(tier, tmp_path):
    ref, got = _train_and_evaluate(_options(tier, tmp_path))
    _assert_equal_runs(ref, got)


def test_inference_mode_with_inductor_and_nvme(tmp_path):
    """Inductor reorders float sums, so equal to eager within fp32 rounding of a few ulps."""
    ref, got = _train_and_evaluate(_options("nvme", tmp_path, compiler="inductor"), steps=2)
    _assert_equal_runs(ref, got, exact=False)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_gathered_under_inference_mode_then_training_goes_on(tier, tmp_path):
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    cmodel = torch.compile(model, backend="zinf", options=_options(tier, tmp_path))
    zopt = zinf_compile.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = make_batch(CFG, 4, seed=0)
    for step in range(2):
        cmodel(x, y).backward(); zopt.step(); zopt.zero_grad()
        ref(x, y).backward(); ropt.step(); ropt.zero_grad()
        with torch.inference_mode():
            with zinf_compile.gathered(model):
                doubled = model.tok.weight * 2
            assert torch.equal(doubled, ref.tok.weight * 2)
            full = zinf_compile.full_state_dict(model)
        assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    assert torch.equal(cmodel(x, y), ref(x, y))


def test_checkpoint_saved_and_loaded_under_inference_mode_resumes_as_eager(tmp_path):
    """A validation-end callback saves under inference mode; training then goes on, and a load under
    inference mode brings back the saved step, momentum included (SGD steps after it match eager's)."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    cmodel = torch.compile(model, backend="zinf", options=_options("nvme", tmp_path / "swap"))
    zopt = zinf_compile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    batches = [make_batch(CFG, 4, seed=s) for s in range(3)]
    (tmp_path / "swap").mkdir()
    cmodel(*batches[0]).backward(); zopt.step(); zopt.zero_grad()
    ref(*batches[0]).backward(); ropt.step(); ropt.zero_grad()
    saved_ref = (copy.deepcopy(ref.state_dict()), copy.deepcopy(ropt.state_dict()))
    with torch.inference_mode():
        zinf_compile.save(str(tmp_path / "ck"), cmodel, zopt)
    cmodel(*batches[1]).backward(); zopt.step(); zopt.zero_grad()  # a step the load then undoes
    with torch.inference_mode():
        zinf_compile.load(str(tmp_path / "ck"), cmodel, zopt)
    ref.load_state_dict(saved_ref[0]); ropt.load_state_dict(saved_ref[1])
    for x, y in batches[1:]:
        zl = cmodel(x, y); zl.backward(); zopt.step(); zopt.zero_grad()
        rl = ref(x, y); rl.backward(); ropt.step(); ropt.zero_grad()
        assert torch.equal(zl, rl)
    full = zinf_compile.full_state_dict(model)
    assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items())


def test_hf_generate_under_inference_mode_between_training_steps(tmp_path):
    """Sampling from the model between steps, as training scripts do: greedy ``generate`` (a KV cache,
    a new length each token) under inference mode gives eager's tokens, and training goes on as
    eager's. Dropout off: both sides then draw no random numbers."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg)
    model = copy.deepcopy(ref)
    model.compile(backend="zinf", options=_options("nvme", tmp_path))
    zopt = zinf_compile.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    for step in range(2):
        for m, opt in ((model, zopt), (ref, ropt)):
            m.train()
            m(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            m.eval()
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = model.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
            want = ref.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert got.shape == (2, 14) and torch.equal(got, want), step
    model.train()
    ref.train()
    assert torch.equal(model(x, labels=x).loss, ref(x, labels=x).loss)
