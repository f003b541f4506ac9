"""One row of ``benchmarks/compare.py``: trains the shared GPT-style model under one system, in its own process.

Launched by ``compare.py`` with plain ``python`` (dp = 1) or under ``torchrun`` (dp = 2, gloo), so no
allocator state, compile cache or imported library of one system leaks into another's numbers. Every
system gets the same model (``zinf_compile.models.GPT``, seed 0), the same batches
(``make_batch(cfg, global_batch, seed=step)``, each rank its contiguous slice), the same AdamW
hyper-parameters and the same number of threads per process.

A step is forward + backward + optimizer step + zero_grad. Each rank times its own steps after a
barrier (not timed), and the step's time is the slowest rank's: the step is done when every rank is.
Peak RSS is each rank's ``VmHWM`` (the kernel's high-water mark, not a sample): over the whole run,
and over the timed steps alone (reset after the warm-up), which leaves out the first step's compile.

Rank 0 writes a JSON result; on an exception every rank writes ``<out>.rank<r>.err`` with the
exception's first line, which ``compare.py`` shows in the table instead of dropping the row.

    before:  python _compare_worker.py --system inductor --cfg '{...}' --out r.json
    after:   r.json = {"step_s": [...], "first_step_s": ..., "rss_hwm_kib": [...], "loss": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _procmem import reset_hwm  # noqa: E402

# the optimizer every row uses (DeepSpeed builds its own AdamW from the same numbers)
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# which torch AdamW kernel the torch rows (eager, Inductor, FSDP2, zinf) step with. "default": torch's own
# choice, the for-loop over tensors on CPU (what a script that passes neither flag gets). "fused": one
# fused kernel per step (``fused=True``), what an expert sets on CPU, about 2.5x faster over this
# model's shards on one thread. DeepSpeed's offload rows always use its own SIMD DeepSpeedCPUAdam.
ADAM_KINDS = ("default", "fused")


def adamw_kwargs(adam: str = "default") -> Dict[str, Any]:
    """``torch.optim.AdamW``'s keyword arguments for a row: ``ADAMW`` plus the kernel choice."""
    if adam not in ADAM_KINDS:
        raise ValueError(f"adam {adam!r}: use one of {', '.join(ADAM_KINDS)}")
    return dict(ADAMW, fused=True) if adam == "fused" else dict(ADAMW)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else 0


def _io_bytes() -> Tuple[int, int]:
    """(read_bytes, write_bytes) this process made the block layer move: what a row really asks of the
    disk (O_DIRECT and buffered alike), as opposed to what its own counters say."""
    with open("/proc/self/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    return int(io["read_bytes"]), int(io["write_bytes"])


def _cpu_s() -> float:
    """CPU seconds of this process so far, every thread's (the compute, gloo's, the runtime's IO and copy
    threads, DeepSpeed's): the work a row's step costs, which a shared machine's other load does not
    change the way it changes the wall time."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _rank_world() -> Tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


# ------------------------------------------------------------------------------------------------
# the systems: each returns (step function, notes) for the model built from seed 0
# ------------------------------------------------------------------------------------------------
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _plain(model: torch.nn.Module, compiled: bool, adam: str) -> Tuple[Step, Dict[str, Any]]:
    run = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(adam))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = run(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, {"optimizer": "torch.optim.AdamW", "adam": adam}


def fsdp2_shard(model: torch.nn.Module, offload: bool) -> None:
    """``fully_shard`` on each block and on the root, as every FSDP2 row of the benchmarks does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    # pin_memory=False: pinning needs a CUDA driver, and on a CPU-only machine it is refused
    kw: Dict[str, Any] = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {"mesh": mesh}
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)  # the root: embeddings (tied to the head), final LayerNorm


def _fsdp2(model: torch.nn.Module, offload: bool, adam: str) -> Tuple[Step, Dict[str, Any]]:
    fsdp2_shard(model, offload)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(adam))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, {"optimizer": "torch.optim.AdamW over DTensor shards", "adam": adam, "wrap": "each Block + root",
                  "offload_policy": "CPUOffloadPolicy(pin_memory=False)" if offload else None}


def _largest_param(model: torch.nn.Module) -> int:
    return max(p.numel() for p in model.parameters())


def _deepspeed(model: torch.nn.Module, offload: str, global_batch: int, nvme: str) -> Tuple[Step, Dict[str, Any]]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401  (ImportError here is the row's "why")

    world = int(os.environ["WORLD_SIZE"])
    zero: Dict[str, Any] = {"stage": 3}
    if offload == "cpu":
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        # buffer_size must hold the largest parameter (the tied embedding); DeepSpeed's default (1e8
        # elements x 5 buffers = 2 GB per rank) would only inflate its RSS on these models
        buf = _largest_param(model)
        # DeepSpeed's default max_in_cpu (1e9 elements) keeps every parameter of a model this size in
        # CPU memory and swaps only the optimizer state (row zinf-cpunvme-dp2 is zinf's like for
        # like). max_in_cpu=0, the parameters on NVMe as in zinf-nvme, fails in fp32 at the large
        # size: "expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 5, "buffer_size": buf}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    cfg = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": global_batch // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                  "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"]}},
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                             dist_init_required=False)
    inner = getattr(opt, "optimizer", opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step, {"optimizer": type(inner).__name__, "deepspeed": deepspeed.__version__,
                  "accelerator": os.environ["DS_ACCELERATOR"], "zero_optimization": zero}


def _zinf(model: torch.nn.Module, offload: str, nvme: str, adam: str) -> Tuple[Step, Dict[str, Any]]:
    import zinf_compile

    # "cpunvme": parameters in CPU memory, optimizer state (masters, moments, gradients) on NVMe
    params, optim = ("cpu", "nvme") if offload == "cpunvme" else (offload, offload)
    options: Dict[str, Any] = {"offload_params": params, "offload_optimizer": optim}
    if optim == "nvme":
        options["nvme_path"] = nvme
    cmodel = torch.compile(model, backend="zinf", options=options)
    opt = zinf_compile.optim.AdamW(model.parameters(), **adamw_kwargs(adam))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = cmodel(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, {"optimizer": "zinf_compile.optim.AdamW", "adam": adam, "options": options}


def build(system: str, model: torch.nn.Module, global_batch: int, nvme: str,
          adam: str = "default") -> Tuple[Step, Dict[str, Any]]:
    """``system`` is a row family from ``compare.py``: eager, inductor, fsdp2[-cpu], ds[-cpu|-nvme], zinf[-cpu|-nvme].
    ``adam``: the torch AdamW kernel (``ADAM_KINDS``); DeepSpeed rows take their own."""
    family, _, tier = system.partition("-")
    if family in ("eager", "inductor"):
        return _plain(model, compiled=family == "inductor", adam=adam)
    if family == "fsdp2":
        return _fsdp2(model, offload=tier == "cpu", adam=adam)
    if family == "ds":
        return _deepspeed(model, tier or "none", global_batch, nvme)
    if family == "zinf":
        return _zinf(model, tier or "none", nvme, adam)
    raise ValueError(f"unknown system {system!r}")


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from zinf_compile.models import GPT, GPTConfig, make_batch

    rank, world = _rank_world()
    torch.set_num_threads(args.threads)
    if world > 1:
        dist.init_process_group("gloo")
    cfg = GPTConfig(**json.loads(args.cfg))
    per = args.global_batch // world
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    step, notes = build(args.system, model, args.global_batch, args.nvme, args.adam)
    setup_s = time.perf_counter() - t0
    if rank == 0:
        print(f"{args.system}: {n_params:,} params, set up in {setup_s:.1f} s", file=sys.stderr, flush=True)
    times: List[float] = []
    losses: List[float] = []
    io0, cpu0 = (0, 0), 0.0
    hwm_before, steady = 0, False
    for i in range(1 + args.warmup + args.steps):
        if i == 1 + args.warmup:
            io0, cpu0 = _io_bytes(), _cpu_s()
            # the peak so far (the compile's included); then the timed steps' own peak from here
            hwm_before, steady = _status_kib("VmHWM"), reset_hwm()
        x, y = make_batch(cfg, args.global_batch, seed=i)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if world > 1:
            dist.barrier()
        t = time.perf_counter()
        loss = step(x, y)
        losses.append(float(loss.detach()))  # on CPU the step is done when it returns
        times.append(time.perf_counter() - t)
        if rank == 0:  # progress for the row's log (a timed-out row shows how far it got)
            print(f"step {i}: {times[-1]:.3f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    hwm_steps = _status_kib("VmHWM")
    hwm = max(hwm_before, hwm_steps)  # the whole run's peak, as before the reset
    io1, cpu = _io_bytes(), (_cpu_s() - cpu0) / max(1, args.steps)  # per timed step, this rank
    io = [(b - a) / max(1, args.steps) for a, b in zip(io0, io1)]
    if args.nvme:  # what this row keeps on the disk: shows whether parameters really live there
        notes["nvme_folder_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.nvme)
                                         for f in fs if os.path.isfile(os.path.join(d, f)))
    if world > 1:
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, (times, losses, hwm, setup_s, io, hwm_steps if steady else None, cpu))
    else:
        gathered = [(times, losses, hwm, setup_s, io, hwm_steps if steady else None, cpu)]
    if rank == 0:
        steps = [max(g[0][i] for g in gathered) for i in range(len(times))]
        mean_losses = [sum(g[1][i] for g in gathered) / world for i in range(len(times))]
        result = {
            "system": args.system, "dp": world, "threads": torch.get_num_threads(), "params": n_params,
            "setup_s": max(g[3] for g in gathered), "first_step_s": steps[0],
            "warmup_s": steps[1:1 + args.warmup], "step_s": steps[1 + args.warmup:],
            "losses": mean_losses, "rss_hwm_kib": [g[2] for g in gathered], "notes": notes,
            # each rank's peak RSS over the timed steps alone (VmHWM reset after the warm-up; None where
            # the kernel refused the reset): training's memory, without the first step's compile
            "rss_hwm_steps_kib": [g[5] for g in gathered],
            # disk bytes per timed step, summed over ranks (/proc/self/io read_bytes, write_bytes)
            "disk_read_per_step": sum(g[4][0] for g in gathered),
            "disk_write_per_step": sum(g[4][1] for g in gathered),
            # CPU seconds per timed step, summed over ranks (every thread of each rank's process)
            "cpu_per_step_s": sum(g[6] for g in gathered),
            "torch": torch.__version__,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system", required=True)
    ap.add_argument("--cfg", required=True, help="GPTConfig fields as JSON")
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--nvme", default="", help="an existing folder for NVMe offload (its own per row)")
    ap.add_argument("--adam", default="default", choices=ADAM_KINDS, help="torch AdamW kernel of the torch rows")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        run(args)
        sys.stdout.flush()
        sys.stderr.flush()
        # the result is written: leave now. DeepSpeed's threads hold an ordinary interpreter exit
        # for about 4 minutes on this machine (ranks sit as zombies), and no figure includes the exit
        os._exit(0)
    except BaseException as e:  # the row's "why": the error's first line, and the traceback for the log
        rank, _ = _rank_world()
        first = (str(e).strip().splitlines() or [""])[0]
        with open(f"{args.out}.rank{rank}.err", "w") as f:
            f.write(f"{type(e).__name__}: {first}\n")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait in a collective for a peer that will never come


if __name__ == "__main__":
    main()
