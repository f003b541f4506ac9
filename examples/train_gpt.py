"""Train a GPT-style model on real text under ``backend="zinf"``, its states offloaded to NVMe.

    python examples/train_gpt.py                                  # the demo (`make demo`): ~1 minute on 2 cores
    python examples/train_gpt.py --offload-params cpu --offload-optimizer none
    python examples/train_gpt.py --tiles 8                        # every matmul weight in 8 tiles
    torchrun --nproc-per-node 2 examples/train_gpt.py             # data parallel (dp = 2, gloo on CPU):
                                                                  # every parameter sharded 1/2 per rank

What the defaults show: the model's parameters and its optimizer (fp32 masters, gradients, Adam
moments) live on NVMe, in a temporary folder removed at the end; the device is allowed a
``device_memory_budget`` far below the model states, so the forward/backward gather one layer's
weights at a time and the largest matmuls run in tiles. The text is the Python standard library's
own source (``Lib/*.py``), read as bytes (vocabulary 256): no download, no tokenizer. The loss
starts near ln 256 = 5.55 and falls; a table at the end sets zinf's memory beside what eager
PyTorch would hold. The model is unmodified PyTorch and the optimizer plain ``torch.optim.AdamW``:
the only zinf-specific line is the compile call.

Graph dumps: ``--dump-dir DIR`` writes every graph after every pass (read them with
``zinf inspect DIR``); ``TORCH_TRACE=DIR`` records them as torch structured-trace artifacts too.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import resource
import shutil
import sys
import sysconfig
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

import zinf_compile
import zinf_runtime
from zinf_compile.models import GPT, GPTConfig

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9}


def parse_bytes(text: str) -> Optional[int]:
    """``"auto"`` -> None; ``"4096"``, ``"512KiB"``, ``"1.5MiB"``, ``"2G"`` -> bytes."""
    if text.lower() == "auto":
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count; use e.g. 1048576, 512KiB, 1MiB or auto")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a byte count must be at least 1")
    return n


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def stdlib_corpus(max_bytes: int) -> tuple[torch.Tensor, str]:
    """The Python standard library's source files, concatenated as bytes (real text that ships
    with every Python), and a description of where they came from."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1 << 16:
        raise SystemExit(f"train_gpt: found only {total} bytes of Python source under {root}; "
                         "this example needs the standard library's .py files")
    text = b"".join(chunks)[:max_bytes]
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    return data, f"{len(chunks)} files of {root}/*.py, {fmt_bytes(len(text))}"


def get_batch(data: torch.Tensor, batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``seq + 1`` bytes: inputs and next-byte targets."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    win = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def peak_rss() -> tuple[int, str]:
    """This process's peak resident set size and where the figure came from."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "VmHWM"
    except OSError:
        pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if sys.platform == "darwin" else 1024), "getrusage"


def nvme_io(model: torch.nn.Module) -> dict[str, int]:
    """Payload bytes the model's swap engines read and wrote, their peak disk use, and the reads the
    read cache served from memory instead (``zinf_compile.io_stats``)."""
    st = zinf_compile.io_stats(model)
    return {**{k: int(st["nvme"][k]) for k in ("bytes_read", "bytes_written", "peak_disk_bytes")},
            "cache_hits": int(st["read_cache"]["hits"])}


def tile_plans() -> dict[str, int]:
    """Parameter name -> tile count of every matmul weight the compiles chose to tile."""
    plans: dict[str, int] = {}
    for rec in zinf_compile.compile_records():
        for snap in rec.snapshots:
            for z in snap.zinf_nodes:
                if z.get("kind") == "tile_plan":
                    plans[str(z.get("param"))] = int(z["tiles"])
    return plans


def auto_budget(model: GPT) -> int:
    """A device budget far below the model states that still runs: the embeddings (the token
    embedding is tied to the LM head, so it is used other than as a matmul weight and cannot be
    tiled) must be gathered whole with room for their neighbours; every block weight is tiled
    to fit it."""
    embed = model.tok.weight.nbytes + model.pos.weight.nbytes
    largest = max(p.nbytes for p in model.blocks.parameters() if p.dim() == 2)
    return max(largest, 2 * embed)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run = ap.add_argument_group("training")
    run.add_argument("--steps", type=int, default=24, help="optimizer steps (default: 24)")
    run.add_argument("--batch", type=int, default=32,
                     help="global batch in sequences; under torchrun it is split across the ranks (default: 32)")
    run.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    run.add_argument("--log-every", type=int, default=3, help="print the loss every N steps (default: 3)")
    run.add_argument("--seed", type=int, default=0, help="seeds the init and the batches (default: 0)")
    run.add_argument("--corpus-bytes", type=parse_bytes, default=2 << 20,
                     help="bytes of standard-library source to train on (default: 2MiB)")
    size = ap.add_argument_group("model size (GPT-style, bytewise vocabulary of 256)")
    size.add_argument("--layers", type=int, default=4, help="transformer blocks (default: 4)")
    size.add_argument("--hidden", type=int, default=128, help="hidden width (default: 128)")
    size.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    size.add_argument("--seq", type=int, default=64, help="context length in bytes (default: 64)")
    zinf = ap.add_argument_group("zinf (data parallel: launch with torchrun --nproc-per-node N; "
                                 "every parameter is then sharded 1/N per rank)")
    zinf.add_argument("--offload-params", default="nvme", choices=["none", "cpu", "nvme"],
                      help="tier of the parameter shards forward/backward fetch (default: nvme)")
    zinf.add_argument("--offload-optimizer", default="nvme", choices=["none", "cpu", "nvme"],
                      help="tier of fp32 masters, gradient shards and Adam moments (default: nvme)")
    zinf.add_argument("--nvme-path", default=None,
                      help="directory for the NVMe tier (default: a fresh temporary folder, removed at the end)")
    zinf.add_argument("--device-memory-budget", type=parse_bytes, default=None, metavar="BYTES|auto",
                      help="bytes of gathered parameters + gradients allowed on the device, e.g. 512KiB; "
                           "matmul tile counts are chosen to fit (default: auto = the larger of the "
                           "largest block weight and twice the embeddings, which cannot be tiled: "
                           "~2.5%% of the model states here; the MLP weights run in 4 tiles)")
    zinf.add_argument("--tiles", type=int, default=None,
                      help="tile every matmul weight of the blocks this many ways (sets the backend's "
                           "tiles=N with tile_threshold_bytes=0; default: tile counts follow the budget)")
    zinf.add_argument("--compiler", default="eager", choices=["eager", "inductor"],
                      help="code generator for the compute between zinf ops (default: eager: at width 192 "
                           "Inductor's first step took 110 s on 2 CPU cores, eager's 6.5 s, for about "
                           "the same step time)")
    zinf.add_argument("--mixed-precision", default=None, choices=["bf16", "fp16"])
    zinf.add_argument("--dump-dir", default=None,
                      help="write every graph after every pass, and the memory plan, here (zinf inspect DIR)")
    zinf.add_argument("--trace", default=None, metavar="PATH",
                      help="write a Chrome/Perfetto trace of one step here (compute, NVMe, copies, "
                           "collectives, optimizer lanes; open in ui.perfetto.dev)")
    zinf.add_argument("--trace-step", type=int, default=1, metavar="N",
                      help="the step --trace records, counted from 0 (default 1, the step after compiling; "
                           "2 or later for the steady state of an NVMe run)")
    zinf.add_argument("--prefetch-depths", default=None, metavar="NC,CG,GG",
                      help="lookahead of the NVMe read, upload and all-gather in operators (default 3,2,1; "
                           "0,0,0 = serial)")
    return ap


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if args.batch % world:
        raise SystemExit(f"train_gpt: --batch {args.batch} does not split across {world} ranks; "
                         f"use a multiple of {world}")
    say = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=256, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    budget = args.device_memory_budget if args.device_memory_budget is not None else auto_budget(model)
    data, source = stdlib_corpus(args.corpus_bytes)

    tmp = None
    nvme_path = args.nvme_path
    if "nvme" in (args.offload_params, args.offload_optimizer) and nvme_path is None:
        tmp = nvme_path = tempfile.mkdtemp(prefix="zinf-demo-nvme-")
    options: dict[str, Any] = {"offload_params": args.offload_params, "offload_optimizer": args.offload_optimizer,
                               "nvme_path": nvme_path, "device_memory_budget": budget, "tiles": args.tiles,
                               **({"tile_threshold_bytes": 0} if args.tiles is not None else {}),
                               "compiler": args.compiler, "mixed_precision": args.mixed_precision,
                               "dump_dir": args.dump_dir, "trace": args.trace, "trace_step": args.trace_step}
    if args.prefetch_depths:
        options["prefetch_depths"] = tuple(int(v) for v in args.prefetch_depths.split(","))
    try:
        cmodel = torch.compile(model, backend="zinf", options=options)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        # fp32 params + grads + two Adam moments, per rank: the model states ZeRO partitions
        states = 16 * n_params
        say(f"GPT-style model: {n_params / 1e6:.2f}M parameters, {cfg.layers} layers, hidden {cfg.hidden}, "
            f"context {cfg.seq} bytes; dp={world}")
        say(f"text: {source}, bytewise (vocab 256)")
        say(f"model states (fp32 params + grads + Adam moments): {fmt_bytes(states)}; device_memory_budget "
            f"{fmt_bytes(budget)} ({budget / states:.1%} of them)")
        say(f"params on {args.offload_params}, optimizer on {args.offload_optimizer}"
            + (f", NVMe folder {nvme_path}" if nvme_path else "") + f"; compiler={args.compiler}")
        losses = train(cmodel, model, opt, data, args, rank, world, say)
        report(model, n_params, states, budget, losses, world, say)
    finally:
        for ctx in zinf_runtime.contexts_of(model):
            for eng in ctx.engines():
                eng.wait_all()  # no write still in flight into the folder removed below
        if tmp is not None:  # the swap engines' own folders inside it go with it
            shutil.rmtree(tmp, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def train(cmodel: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor,
          args: argparse.Namespace, rank: int, world: int, say: Any) -> list[float]:
    from tqdm import tqdm

    per = args.batch // world
    g = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    warmup = max(1, min(10, args.steps // 4))  # a short linear warm-up
    bar = tqdm(range(args.steps), desc="train", unit="step", disable=rank != 0, dynamic_ncols=True)
    t_first = t_start = time.perf_counter()
    for step in bar:
        x, y = get_batch(data, args.batch, args.seq, g)  # same global batch on every rank; each takes its slice
        lr = args.lr * min(1.0, (step + 1) / warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = cmodel(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.zero_grad()
        loss = loss.detach()
        if world > 1:  # log the global batch's loss, not this rank's slice
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
        if step == 0:
            t_first = time.perf_counter() - t_start
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            recent = losses[-5:]
            bar.write(f"step {step:4d}  loss {losses[-1]:.4f}  (mean of last {len(recent)}: "
                      f"{sum(recent) / len(recent):.4f})" + ("  includes compile" if step == 0 else ""))
    bar.close()
    total = time.perf_counter() - t_start
    rest = args.steps - 1
    say(f"first step {t_first:.1f} s (compile included)"
        + (f", then {(total - t_first) / rest:.2f} s/step" if rest else ""))
    return losses


def report(model: torch.nn.Module, n_params: int, states: int, budget: int, losses: list[float], world: int,
           say: Any) -> None:
    k = min(5, len(losses))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    say(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} (mean of first {k} steps {first:.3f}, "
        f"of last {k} {last:.3f}; ln 256 = {math.log(256):.3f})")
    plans = tile_plans()
    if plans:
        say("tiled matmuls: " + ", ".join(f"{name} x{t}" for name, t in sorted(plans.items())))
    stats = zinf_compile.memory_stats(model)
    gathered = stats["device"]["gathered"]["peak"]
    materialized = stats["device"]["materialized"]["peak"]
    rss, rss_src = peak_rss()
    io = nvme_io(model)
    per_rank = states // world
    rows = [
        ("model states (fp32 params+grads+Adam m,v)", fmt_bytes(per_rank), fmt_bytes(states)),
        ("  of which held in device memory", fmt_bytes(sum(stats["device"][t]["peak"] for t in ("param", "grad", "optim"))),
         fmt_bytes(states)),
        ("peak full parameters gathered on the device", fmt_bytes(gathered), fmt_bytes(4 * n_params)),
        ("peak gathered params + grad buffers", fmt_bytes(materialized), fmt_bytes(8 * n_params)),
        ("device_memory_budget", fmt_bytes(budget), "-"),
        ("peak RSS of this process", fmt_bytes(rss), "-"),
        ("NVMe peak disk use", fmt_bytes(io["peak_disk_bytes"]), "0 B"),
        ("NVMe bytes read", fmt_bytes(io["bytes_read"]), "0 B"),
        ("  reads served by the read cache instead", str(io["cache_hits"]), "-"),
        ("NVMe bytes written", fmt_bytes(io["bytes_written"]), "0 B"),
    ]
    w0 = max(len(r[0]) for r in rows)
    say("")
    say(f"{'memory' + (' (rank 0 of ' + str(world) + ')' if world > 1 else ''):<{w0}}  {'zinf':>12}  {'eager PyTorch':>14}")
    for name, z, e in rows:
        say(f"{name:<{w0}}  {z:>12}  {e:>14}")
    say("zinf: device figures are the runtime's accounting (zinf_compile.memory_stats(model), peaks; the device "
        "is the CPU here), NVMe figures the swap engines' counters (zinf_compile.io_stats(model)), peak RSS "
        "from " + rss_src + " (Python, torch, the compiler and activations included).")
    say("eager PyTorch: computed, not run: it keeps every model state in device memory and all parameters "
        "materialized at once; its RSS is at least the model states plus the same process baseline.")


if __name__ == "__main__":
    main()
