"""dp = 2 worker: an accelerate training loop, eager (the model prepared: DistributedDataParallel) or zinf.

zinf reduce-scatters the gradients itself, so the zinf loop leaves the model out of
``accelerator.prepare`` and prepares the rest (optimizer, LR scheduler), as the README's recipe says;
everything else is the same loop: ``accumulate`` over two micro-batches, ``backward``,
``clip_grad_norm_`` on the synchronizing micro-batch, the scheduler, ``zero_grad``. Then
``save_state`` (the main process writes the optimizer, as accelerate does) and ``load_state`` on every
rank: zinf's optimizer state is rank 0's shards, which rank 1 must refuse with the error naming the fix.
The zinf loop also saves and loads its own checkpoint (``zinf_compile.save`` / ``load``) through the
prepared optimizer, which wraps zinf's. Writes ``result{rank}.pt`` under OUT.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from accelerate import Accelerator

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch


def main(mode: str, out: str) -> None:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    cfg = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    if mode == "zinf":
        run = torch.compile(model, backend="zinf", options={"compiler": "eager", "offload_optimizer": "cpu"})
        opt, sched = acc.prepare(opt, sched)  # not the model: zinf shards it and reduces its gradients
    else:
        run, opt, sched = acc.prepare(model, opt, sched)
    result: dict = {"losses": [], "norms": []}
    for i in range(8):
        x, y = make_batch(cfg, 2, seed=100 * i + acc.process_index)
        with acc.accumulate(run):
            loss = run(x, y)
            acc.backward(loss)
            if acc.sync_gradients:
                result["norms"].append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            sched.step()
            opt.zero_grad()
        result["losses"].append(float(loss))
    result["params"] = zinf_compile.full_state_dict(model) if mode == "zinf" else \
        {k: v.detach().clone() for k, v in model.state_dict().items()}
    result["lr"] = sched.get_last_lr()[0]
    if mode == "zinf":  # zinf's own checkpoint through the prepared (wrapped) optimizer: a round trip
        before = copy.deepcopy(opt.state_dict())
        path = os.path.join(out, "zinf_ckpt")
        zinf_compile.save(path, model, opt)
        zinf_compile.load(path, model, opt)
        after = opt.state_dict()
        result["roundtrip"] = {
            "groups_hold_the_model": [id(p) for g in opt.param_groups for p in g["params"]]
            == [id(p) for p in model.parameters()],
            "wrapper_class": type(opt).__name__,
            "params": zinf_compile.full_state_dict(model),
            "state_equal": before["state"].keys() == after["state"].keys() and all(
                torch.equal(v, after["state"][i][k]) for i, st in before["state"].items() for k, v in st.items()
                if torch.is_tensor(v)),
        }
    ckpt = os.path.join(out, "state")
    acc.save_state(ckpt)
    acc.wait_for_everyone()
    try:
        acc.load_state(ckpt)
        result["load_error"] = None
    except ValueError as exc:
        result["load_error"] = str(exc)
    os.makedirs(out, exist_ok=True)
    torch.save(result, os.path.join(out, f"result{acc.process_index}.pt"))
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
