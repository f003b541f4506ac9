"""The ``zinf`` command line.

Why: planning a ZeRO-Infinity run (what fits where, how many tiles, expected
efficiency) should not require writing Python or importing torch.  Each
subcommand lives in its own ``_add_<name>_parser`` / ``_cmd_<name>`` pair and is
registered in ``_SUBCOMMANDS``, so new ones (e.g. ``inspect``) slot in without
touching the others.

Usage::

    zinf plan --layers 128 --hidden 25600 --heads 160 --seq 1024 --batch 1 --dp 512
    python -m zinf_compile.cli plan ... --json
    zinf inspect DUMP_DIR [--diff] [--graph 0 --stage forward --pass insert_release] [--node NAME]
    zinf memplan gpt --layers 4 --hidden 256 --seq 128 --batch 8 [--offload-params cpu] [--plot m.png]
    zinf bandwidth [--nvme-path DIR] [--refresh] [--json]    # measured once per machine, then cached
    zinf plan ... --measured [--nvme-path DIR]              # --bandwidth from that cache
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields
from typing import Any, Callable, Sequence

from .analytic import DoesNotFitError, Hardware, TransformerSpec, analyze
from .analytic import human_bytes as _human_bytes

__all__ = ["main", "build_parser", "parse_quantity"]

_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_QUANTITY = re.compile(
    r"\s*(?P<num>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*"
    r"(?P<prefix>[kKmMgGtTpP]?)(?P<bin>i?)(?P<unit>[A-Za-z]*)(?P<rate>/s)?\s*")


def parse_quantity(text: str, unit: str = "B", rate: bool = False) -> float:
    """Parse ``32GB``, ``1.5TiB``, ``25GB/s``, ``70T`` or ``70TFLOPS`` into a number.

    K/M/G/T/P are decimal (10**3...), Ki/Mi/Gi/Ti/Pi binary (2**10...).  ``unit``
    is the optional trailing unit name ("B" or "FLOPS"); ``rate`` allows a
    trailing ``/s``.  Raises ValueError with an example of the accepted forms.
    """
    m = _QUANTITY.fullmatch(text)
    accepted = {"B": ("", "B"), "FLOPS": ("", "FLOP", "FLOPS")}[unit]
    example = {"B": "32GB, 1.5TiB" + (", 25GB/s" if rate else ""), "FLOPS": "70T, 70TFLOPS, 7e13"}[unit]
    bad = ValueError(f"cannot parse {text!r}; expected a number with an optional K/M/G/T/P "
                     f"(decimal) or Ki/Mi/Gi/Ti/Pi (binary) prefix, e.g. {example}")
    if m is None or (m["rate"] and not rate) or m["unit"].upper() not in accepted:
        raise bad
    prefix = m["prefix"].upper()
    if m["bin"]:
        if not prefix:
            raise bad
        scale = _BINARY[prefix]
    else:
        scale = _DECIMAL[prefix]
    return float(m["num"]) * scale


def _bytes_arg(text: str) -> int:
    try:
        return round(parse_quantity(text, "B"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bandwidth_arg(text: str) -> float:
    try:
        return parse_quantity(text, "B", rate=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _flops_arg(text: str) -> float:
    try:
        return parse_quantity(text, "FLOPS", rate=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _human_decimal(n: float, suffix: str) -> str:
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g} {prefix}{suffix}"
        n /= 1000
    return f"{n:.3g} E{suffix}"


# ---------------------------------------------------------------- plan


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="memory, bandwidth and placement model of a transformer (paper Sec. 3-4)",
        description="Evaluate ZeRO-Infinity's analytic model: model-state and activation memory, "
                    "arithmetic intensity, efficiency at a given bandwidth, and where states should live.")
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, required=True, help="number of transformer layers (nl)")
    m.add_argument("--hidden", type=int, required=True, help="hidden size (hd)")
    m.add_argument("--heads", type=int, required=True, help="attention heads")
    m.add_argument("--seq", type=int, required=True, help="sequence length")
    m.add_argument("--batch", type=int, required=True, help="micro-batch size per device (bsz)")
    m.add_argument("--ckpt-interval", type=int, default=1, help="layers between activation checkpoints (ci; default 1)")
    m.add_argument("--dp", type=int, default=1, help="data-parallel devices sharing model states (default 1)")
    m.add_argument("--tiles", type=int, default=1, help="tiles for the largest linear (default 1)")
    hw = Hardware()
    h = p.add_argument_group("hardware (defaults: one DGX-2 node of V100s)")
    h.add_argument("--device-memory", type=_bytes_arg, default=None,
                   help=f"memory per device (default {_human_bytes(hw.device_memory_bytes)})")
    h.add_argument("--cpu-memory", type=_bytes_arg, default=None,
                   help=f"total CPU memory for the dp group (default {_human_bytes(hw.cpu_memory_bytes)})")
    h.add_argument("--nvme", type=_bytes_arg, default=None,
                   help=f"total NVMe for the dp group (default {_human_decimal(hw.nvme_bytes, 'B')})")
    h.add_argument("--bandwidth", type=_bandwidth_arg, default=None,
                   help=f"slow-memory bandwidth per device, e.g. 12GB/s "
                        f"(default {_human_decimal(hw.slow_bandwidth_bytes_per_s, 'B/s')})")
    h.add_argument("--peak-flops", type=_flops_arg, default=None,
                   help=f"peak FLOP/s per device, e.g. 70T (default {_human_decimal(hw.peak_flops_per_s, 'FLOP/s')})")
    h.add_argument("--measured", action="store_true",
                   help="take --bandwidth from this machine's measured link speeds (zinf bandwidth; measured "
                        "once, then cached): the slower of disk read (with --nvme-path) and host->device")
    h.add_argument("--nvme-path", default=None, help="with --measured: the directory NVMe offload would use")
    p.add_argument("--json", action="store_true", help="print analyze()'s result as JSON")
    p.set_defaults(func=_cmd_plan)


_HW_FLAGS = {"device_memory": "device_memory_bytes", "cpu_memory": "cpu_memory_bytes", "nvme": "nvme_bytes",
             "bandwidth": "slow_bandwidth_bytes_per_s", "peak_flops": "peak_flops_per_s"}


def _measured_slow_bandwidth(nvme_path: str | None) -> float:
    """The slow-memory -> device rate the plan assumes, from the cached measurement (torch imported here)."""
    from .costmodel import bandwidths

    bw = bandwidths(nvme_path)
    rates = [bw.h2d] + ([bw.disk_read] if bw.disk_read else [])
    return min(rates)


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.measured:
        if args.bandwidth is not None:
            raise ValueError("--measured and --bandwidth both set the slow-memory bandwidth; pass one of them")
        args.bandwidth = _measured_slow_bandwidth(args.nvme_path)
    elif args.nvme_path is not None:
        raise ValueError("--nvme-path only applies with --measured")
    spec = TransformerSpec(**{f.name: getattr(args, f.name) for f in fields(TransformerSpec)})
    hw = Hardware(**{field: getattr(args, flag) for flag, field in _HW_FLAGS.items()
                     if getattr(args, flag) is not None})
    result = analyze(spec, hw)
    if args.json:
        print(json.dumps(result, sort_keys=True, indent=2))
    else:
        print(_format_plan(spec, hw, result))
    if not result["fits"]:  # every figure is printed above; the exit status still says it does not fit
        print(f"zinf plan: {result['placement']['recommendation']}", file=sys.stderr)
        return 1
    return 0


def _format_plan(spec: TransformerSpec, hw: Hardware, r: dict[str, Any]) -> str:
    """Readable, aligned report of analyze()'s result."""
    pl = r["placement"]
    rows: list[tuple[str, str]] = [
        ("parameters", f"{_human_decimal(r['params'], '').strip()} ({r['params']:,})"),
        ("model states (20 B/param)", f"{_human_bytes(r['model_state_bytes'])}  "
                                      f"({_human_bytes(r['model_state_bytes'] / spec.dp)} per device at dp={spec.dp})"),
        (f"working memory (tiles={spec.tiles})", _human_bytes(r["working_memory_bytes"])),
        ("activation working memory", _human_bytes(r["activation_working_memory_bytes"])),
        ("activation checkpoints", _human_bytes(r["activation_checkpoint_bytes"]) + " per device"),
        ("FLOPs per iteration", _human_decimal(r["flops_per_iteration"], "FLOPs") + " per device"),
    ]
    bw = _human_decimal(hw.slow_bandwidth_bytes_per_s, "B/s")
    peak = _human_decimal(hw.peak_flops_per_s, "FLOP/s")
    eff = r["efficiency"]
    rows += [
        ("AIT param/grad", f"{r['ait_param_grad']:,}  -> efficiency {eff['param_grad']:.1%}"),
        ("AIT optimizer", f"{r['ait_optimizer']:,g}  -> efficiency {eff['optimizer']:.1%}"),
        ("AIT activation checkpoint",
         f"{r['ait_activation_checkpoint']:,}  -> efficiency {eff['activation_checkpoint']:.1%}"),
    ]
    rows += [(f"place {k.replace('_', ' ')}", "not placed" if pl[k] is None else str(pl[k]))
             for k in ("params", "optimizer", "activation_checkpoints")]
    rows.append(("recommended tiles", "none fits" if pl["tiles"] is None else str(pl["tiles"])))
    rows.append(("fits", "yes" if r["fits"] else "NO"))
    width = max(len(k) for k, _ in rows)
    lines = [f"ZeRO-Infinity plan: nl={spec.layers} hd={spec.hidden} heads={spec.heads} seq={spec.seq} "
             f"bsz={spec.batch} ci={spec.ckpt_interval} dp={spec.dp}",
             f"hardware: {_human_bytes(hw.device_memory_bytes)}/device, {_human_bytes(hw.cpu_memory_bytes)} CPU, "
             f"{_human_bytes(hw.nvme_bytes)} NVMe, {bw} and {peak} per device", ""]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    lines += ["", f"recommendation: {pl['recommendation']}", "", "why:"]
    lines += [f"  - {text}" for text in pl["reason"].values()]
    return "\n".join(lines)


# ---------------------------------------------------------------- inspect, memplan (code in their modules)


def _add_inspect_parser(sub: argparse._SubParsersAction) -> None:
    from .inspect import __doc__ as doc, add_arguments, run

    p = sub.add_parser("inspect", help="list, diff and explain the graphs a compile dumped (dump_dir)",
                       description=doc.split("\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


def _add_memplan_parser(sub: argparse._SubParsersAction) -> None:
    from .memory_plan import __doc__ as doc, add_arguments, run_cli  # the module, not the exported function

    p = sub.add_parser("memplan", help="static memory plan of one training step (per tier, per kind)",
                       description=doc.split("\n")[0])
    add_arguments(p)
    p.set_defaults(func=run_cli)


def _add_bandwidth_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bandwidth", help="this machine's link speeds (disk, host<->device), measured once and cached",
                       description="Print the bandwidths of the links zinf moves parameters over: disk read and "
                                   "write through zinf's swap engine (with --nvme-path), host->device and "
                                   "device->host copies. Measured by a microbenchmark of a few seconds the first "
                                   "time, then read from a cache keyed by host, device and the path's filesystem "
                                   "(~/.cache/zinf, $ZINF_CACHE_DIR or --cache-dir).")
    p.add_argument("--nvme-path", default=None, help="directory on the disk NVMe offload would use (default: no disk)")
    p.add_argument("--cache-dir", default=None, help="cache folder (default $ZINF_CACHE_DIR or ~/.cache/zinf)")
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.add_argument("--measure-bytes", type=_bytes_arg, default=None, help="bytes per timed transfer (default 32MiB)")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.set_defaults(func=_cmd_bandwidth)


def _cmd_bandwidth(args: argparse.Namespace) -> int:
    from .costmodel import DEFAULT_MEASURE_BYTES, bandwidths, format_table

    bw = bandwidths(args.nvme_path, cache_dir=args.cache_dir, refresh=args.refresh,
                    measure_bytes=args.measure_bytes or DEFAULT_MEASURE_BYTES)
    if args.json:
        print(json.dumps(dict(bw.to_json(), path=bw.path, cached=bw.cached), sort_keys=True, indent=2))
    else:
        print(format_table(bw))
    return 0


# ---------------------------------------------------------------- entry point

_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_plan_parser, _add_inspect_parser, _add_memplan_parser, _add_bandwidth_parser)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand registers itself via _SUBCOMMANDS."""
    parser = argparse.ArgumentParser(prog="zinf", description="ZeRO-Infinity as a torch.compile backend: tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for bad input, 1 when the model does not fit: the plan
    is printed all the same, with ``fits: false`` and the reason in its recommendation)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports usage errors (and --help) by exiting
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return int(args.func(args))
    except DoesNotFitError as exc:
        print(f"zinf {args.command}: does not fit: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"zinf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
