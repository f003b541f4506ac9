"""One training process for tests/test_checkpoint.py: build, compile, (load), train, (save), (die).

Run directly (dp = 1) or under torchrun (dp = WORLD_SIZE, gloo). ``argv[1]`` is a JSON job:

    tier, nvme_path       offload_params = offload_optimizer = tier ("cpu"/"nvme"), nvme swap folder
    optim                 "adamw" or "sgd"
    start, stop           train steps start..stop-1 (batch of step s: make_batch(cfg, global_batch, seed=s))
    accum                 micro-batches per rank and step (default 1), each backward of loss / accum: dp=1
                          with accum=2 replays dp=2's arithmetic exactly (see tests/test_checkpoint.py)
    load                  checkpoint to load right after building the optimizer, before any call
    save_after_load       save here right after loading (a reshard check: no training in between)
    save                  save here after training; ``fault`` makes this save fail:
                          {"kind": "kill" | "enospc", "after_bytes": n}: once n bytes reached the
                          checkpoint's files, SIGKILL this process or raise OSError(ENOSPC)
    kill_after_save       SIGKILL this process right after ``save`` returned
    out                   torch.save'd result (rank 0): losses, full parameters after training, error

A fault is injected below DCP, at the file objects its writer opens (``pathlib.Path.open``), the way a
full disk or a kill would hit a real write.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pathlib
import signal
import sys

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch

CFG = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4, init_std=None)
LR = {"adamw": dict(lr=1e-3, weight_decay=0.1), "sgd": dict(lr=0.05, momentum=0.9)}


def inject(save_path: str, kind: str, after_bytes: int) -> None:
    """Make writes into the checkpoint (``save_path`` or any sibling named from it, e.g. ``.tmp``) fail
    once ``after_bytes`` were written there."""
    target = os.path.abspath(save_path)
    written = [0]
    real_open = pathlib.Path.open

    class Faulty(io.FileIO):
        def write(self, b):  # type: ignore[override]
            n = len(memoryview(b).cast("B"))
            if written[0] + n > after_bytes:
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
            written[0] += n
            return super().write(b)

    def open_(self, mode="r", *args, **kwargs):
        if ("w" in mode or "a" in mode) and str(os.path.abspath(self)).startswith(target):
            return io.BufferedWriter(Faulty(str(self), "w"))
        return real_open(self, mode, *args, **kwargs)

    pathlib.Path.open = open_  # type: ignore[method-assign]


def main() -> None:
    job = json.loads(sys.argv[1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    model = GPT(cfg)
    options = {"offload_params": job["tier"], "offload_optimizer": job["tier"], "compiler": "eager"}
    if job["tier"] == "nvme":
        options["nvme_path"] = job["nvme_path"]
    cmodel = torch.compile(model, backend="zinf", options=options)
    kind = job.get("optim", "adamw")
    opt = (torch.optim.AdamW if kind == "adamw" else torch.optim.SGD)(model.parameters(), **LR[kind])
    result = {"losses": [], "error": None}
    if job.get("load"):
        zinf_compile.load(job["load"], cmodel, opt)
    if job.get("save_after_load"):
        zinf_compile.save(job["save_after_load"], cmodel, opt)
    gb, accum = job.get("global_batch", 8), job.get("accum", 1)
    per = gb // (world * accum)
    for step in range(job["start"], job["stop"]):
        x, y = make_batch(cfg, gb, seed=step)
        t = torch.zeros(())
        for i in range(accum):  # rank r takes micro-batches r*accum .. r*accum+accum-1
            m = rank * accum + i
            loss = cmodel(x[m * per:(m + 1) * per], y[m * per:(m + 1) * per])
            (loss / accum if accum > 1 else loss).backward()
            t = t + loss.detach()
        opt.step()
        opt.zero_grad()
        if world > 1:
            dist.all_reduce(t)
        result["losses"].append(t.item() / (world * accum))
    result["params"] = zinf_compile.full_state_dict(model)
    if job.get("save"):
        if job.get("fault"):
            inject(job["save"], job["fault"]["kind"], job["fault"]["after_bytes"])
        try:
            zinf_compile.save(job["save"], cmodel, opt, extra={"step": job["stop"]})
        except zinf_compile.CheckpointError as exc:
            result["error"] = str(exc)
    if rank == 0 and job.get("out"):
        torch.save(result, job["out"])
    if job.get("save") and job.get("kill_after_save"):
        if world > 1:
            dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
