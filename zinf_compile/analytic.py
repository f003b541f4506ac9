"""The ZeRO-Infinity paper's analytic memory and bandwidth model (arXiv 2104.07857).

Why this exists: before compiling anything, a user wants to know how much
memory a transformer needs, whether the model states fit on the device or must
go to CPU memory or NVMe, how many tiles the largest linear needs, and what
efficiency to expect from a given slow-memory bandwidth.  The paper answers
those with closed-form expressions (Sec. 3 and 4); this module evaluates them.
It is pure Python so the ``zinf plan`` command starts instantly without torch.

Notation follows the paper: ``nl`` layers, ``hd`` hidden size, ``bsz`` batch
size per device, ``seq`` sequence length, ``ci`` activation-checkpoint
interval (layers between checkpoints).

Split of the paper's 20 bytes per parameter of model states (mixed-precision
Adam), used by the placement decision:

* params (+ grads): 4 bytes/param -- fp16 parameter (2) and fp16 gradient (2);
  these are what every forward/backward pass streams.
* optimizer: 16 bytes/param -- fp32 master parameter, fp32 gradient, Adam
  momentum and variance (4 each); only the optimizer step touches them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "TransformerSpec",
    "Hardware",
    "DoesNotFitError",
    "analyze",
    "check_fits",
    "human_bytes",
    "PARAM_GRAD_BYTES_PER_PARAM",
    "OPTIMIZER_BYTES_PER_PARAM",
    "MODEL_STATE_BYTES_PER_PARAM",
    "WORKING_MEMORY_FRACTION",
]

PARAM_GRAD_BYTES_PER_PARAM = 4
"""fp16 parameter + fp16 gradient."""
OPTIMIZER_BYTES_PER_PARAM = 16
"""fp32 master parameter, fp32 gradient, Adam momentum, Adam variance."""
MODEL_STATE_BYTES_PER_PARAM = PARAM_GRAD_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM

WORKING_MEMORY_FRACTION = 1 / 8
"""Share of device memory the (tiled) largest-linear working memory may use.

Chosen so that the paper's example holds on the default 32 GiB device: the
64K-hidden FFN needs 64 GiB untiled and 16 tiles bring it to 4 GiB = 1/8."""

_GiB = 1 << 30
_TiB = 1 << 40

# Field name -> command-line flag, so validation errors name what the user typed.
_FLAGS = {
    "layers": "--layers",
    "hidden": "--hidden",
    "heads": "--heads",
    "seq": "--seq",
    "batch": "--batch",
    "ckpt_interval": "--ckpt-interval",
    "dp": "--dp",
    "tiles": "--tiles",
    "device_memory_bytes": "--device-memory",
    "cpu_memory_bytes": "--cpu-memory",
    "nvme_bytes": "--nvme",
    "slow_bandwidth_bytes_per_s": "--bandwidth",
    "peak_flops_per_s": "--peak-flops",
}


# Example values for error messages.
_EXAMPLES = {"device_memory_bytes": "32GiB", "cpu_memory_bytes": "1.5TiB", "nvme_bytes": "28TB",
             "slow_bandwidth_bytes_per_s": "12GB", "peak_flops_per_s": "70T", "hidden": 8192,
             "heads": 64, "seq": 1024, "layers": 48}


class DoesNotFitError(ValueError):
    """The configuration cannot be placed in device, CPU and NVMe memory combined (``check_fits``)."""


def _check_positive(obj: object, allow_zero: tuple[str, ...] = ()) -> None:
    """Reject non-positive (or non-numeric) fields early, naming the flag and the fix."""
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        flag = _FLAGS.get(f.name, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{flag} must be a number (got {value!r}); pass e.g. {flag} 8")
        if not math.isfinite(value):
            raise ValueError(f"{flag} must be finite (got {value!r}); pass e.g. {flag} {_EXAMPLES.get(f.name, 1)}")
        if f.type == "int" and not isinstance(value, int):
            raise ValueError(f"{flag} must be an integer (got {value!r}); "
                             f"round it, e.g. {flag} {max(1, round(value))}")
        minimum_ok = value >= 0 if f.name in allow_zero else value > 0
        if not minimum_ok:
            bound, cmp = ("non-negative", ">= 0") if f.name in allow_zero else ("positive", "> 0")
            raise ValueError(f"{flag} must be {bound} (got {value!r}); pass a value {cmp}, "
                             f"e.g. {flag} {_EXAMPLES.get(f.name, 1)}")


@dataclass(frozen=True)
class TransformerSpec:
    """Shape of a GPT-like transformer and how it is trained.

    ``batch`` is the micro-batch per device; ``dp`` the number of data-parallel
    devices the model states are partitioned over (ZeRO-3); ``tiles`` how many
    pieces the largest linear is split into (ZeRO-Infinity memory-centric tiling).
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    ckpt_interval: int = 1
    dp: int = 1
    tiles: int = 1

    def __post_init__(self) -> None:
        _check_positive(self)


@dataclass(frozen=True)
class Hardware:
    """Per-device speeds and the memory capacities a data-parallel group can use.

    Defaults describe one NVIDIA DGX-2 node of V100s as in the paper:

    * ``device_memory_bytes``: 32 GiB (V100-32GB HBM2).
    * ``cpu_memory_bytes``: 1.5 TiB, the node's DRAM.  This is the *total* CPU
      memory available to the whole dp group (a node's DRAM is shared by its
      16 GPUs); for several nodes pass nodes x 1.5 TiB.  0 means "no CPU offload".
    * ``nvme_bytes``: 28 TB, the node's NVMe (paper's figure); also a total for
      the dp group.  0 means "no NVMe".
    * ``slow_bandwidth_bytes_per_s``: 12 GB/s per device, an approximate
      effective PCIe Gen3 x16 rate between GPU and CPU memory (an assumption;
      NVMe-backed offload is slower -- lower this flag to model it).
    * ``peak_flops_per_s``: 70 TFLOP/s per device, the paper's achievable fp16
      peak for a V100.
    """

    device_memory_bytes: int = 32 * _GiB
    cpu_memory_bytes: int = 3 * _TiB // 2
    nvme_bytes: int = 28 * 10**12
    slow_bandwidth_bytes_per_s: float = 12e9
    peak_flops_per_s: float = 70e12

    def __post_init__(self) -> None:
        _check_positive(self, allow_zero=("cpu_memory_bytes", "nvme_bytes"))


def human_bytes(n: float) -> str:
    """Binary-unit rendering (``1.50 TiB``) for messages and the CLI table."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _efficiency(ait: float, bandwidth: float, peak: float) -> float:
    """Fraction of peak reached when compute overlaps nothing with data movement.

    compute time / (compute + transfer) = (ait*bw) / (ait*bw + peak), paper Sec. 4.1.
    """
    return ait * bandwidth / (ait * bandwidth + peak)


def _recommend_tiles(spec: TransformerSpec, hw: Hardware) -> tuple[int, str | None]:
    """Smallest power of two >= spec.tiles that keeps the largest linear's
    working memory within WORKING_MEMORY_FRACTION of device memory, and None;
    or the largest tile count tried and why even that does not fit."""
    budget = hw.device_memory_bytes * WORKING_MEMORY_FRACTION
    full = 16 * spec.hidden * spec.hidden
    tiles = 1
    while tiles < spec.tiles:
        tiles *= 2
    # A tile needs at least one output column of the hd -> 4hd linear.
    while _ceil_div(full, tiles) > budget:
        if tiles * 2 > 4 * spec.hidden:
            return tiles, (
                f"the largest linear ({human_bytes(full)} of fp16 param+grad) does not fit in "
                f"{WORKING_MEMORY_FRACTION:.3g} of --device-memory even at {tiles} tiles; "
                "use a device with more memory or a smaller --hidden")
        tiles *= 2
    return tiles, None


_NAMES = {"params": "params+grads (fp16)", "optimizer": "optimizer states (fp32)",
          "activation_checkpoints": "activation checkpoints"}
_KEYS = ("params", "optimizer", "activation_checkpoints")


def _not_fitting(tiles: int | None, work_reason: str, why: str, reason: dict[str, str],
                 placement: dict[str, str | None]) -> dict[str, Any]:
    """The placement of a configuration that does not fit: what could be placed, ``None`` for the
    rest, and the reason in ``recommendation`` (every other figure of the plan is still computed)."""
    for k in _KEYS:
        placement.setdefault(k, None)
        reason.setdefault(k, f"{_NAMES[k]}: not placed, {why}")
    reason["tiles"] = work_reason
    return {**{k: placement[k] for k in _KEYS}, "tiles": tiles,
            "reason": {k: reason[k] for k in _KEYS + ("tiles",)},
            "fits": False, "recommendation": f"does not fit: {why}"}


def _place(spec: TransformerSpec, hw: Hardware, params: int, act_work: int,
           ckpt_bytes: int, aits: dict[str, float]) -> dict[str, Any]:
    """Decide where params(+grads), optimizer states and activation checkpoints live.

    Device budget = device memory - activation working memory - tiled working
    memory.  Each device holds a 1/dp share of model states (ZeRO-3) plus its own
    activation checkpoints.  If everything does not fit, items leave the device
    in this order until the rest fits:

    1. optimizer states: 80% of model states, and ZeRO-Offload runs the step
       where they live, so only fp16 grads/params cross the slow link;
    2. activation checkpoints: highest arithmetic intensity, cheapest to stream;
    3. params + grads: needed by every layer in forward and backward.

    Evicted items that would fit again once later ones left are brought back.
    The rest take the CPU tier in order of increasing arithmetic intensity (the
    most bandwidth-hungry first), spilling to NVMe when the dp group's aggregate
    no longer fits in CPU memory.

    A configuration that cannot be placed is reported, not raised: ``fits`` is
    False, ``recommendation`` says why, and the items that could not be placed
    are ``None``.
    """
    tiles, tiles_problem = _recommend_tiles(spec, hw)
    work = _ceil_div(16 * spec.hidden * spec.hidden, tiles)
    work_reason = (f"{tiles} tile(s) keep the largest linear's working memory at {human_bytes(work)}, "
                   f"within {WORKING_MEMORY_FRACTION:.3g} of device memory")
    if tiles_problem is not None:
        return _not_fitting(None, tiles_problem, tiles_problem, {}, {})
    budget = hw.device_memory_bytes - act_work - work
    if budget < 0:
        why = (f"activation working memory ({human_bytes(act_work)}) plus tiled working memory "
               f"({human_bytes(work)}) exceeds --device-memory ({human_bytes(hw.device_memory_bytes)}); "
               "reduce --batch, --seq or --ckpt-interval")
        return _not_fitting(tiles, work_reason, why, {}, {})

    per_device = {
        "optimizer": _ceil_div(OPTIMIZER_BYTES_PER_PARAM * params, spec.dp),
        "activation_checkpoints": ckpt_bytes,
        "params": _ceil_div(PARAM_GRAD_BYTES_PER_PARAM * params, spec.dp),
    }
    on_device = dict(per_device)
    evicted: list[str] = []
    for item in ("optimizer", "activation_checkpoints", "params"):
        if sum(on_device.values()) <= budget:
            break
        del on_device[item]
        evicted.append(item)
    for item in reversed(evicted[:-1]):
        if sum(on_device.values()) + per_device[item] <= budget:
            on_device[item] = per_device[item]
            evicted.remove(item)

    placement: dict[str, str | None] = {}
    reason: dict[str, str] = {}
    used = sum(on_device.values())
    for item in on_device:
        placement[item] = "device"
        reason[item] = (f"{_NAMES[item]}: {human_bytes(per_device[item])} per device stays on the device "
                        f"({human_bytes(used)} of the {human_bytes(budget)} left after working memory)")
    free = {"cpu": hw.cpu_memory_bytes, "nvme": hw.nvme_bytes}
    problem = None
    for item in sorted(evicted, key=lambda k: aits[k]):
        total = per_device[item] * spec.dp
        what = (f"{_NAMES[item]}: {human_bytes(per_device[item])} per device does not fit in the "
                f"{human_bytes(budget)} left on the device")
        if total <= free["cpu"]:
            placement[item] = "cpu"
            reason[item] = f"{what}, so the group's {human_bytes(total)} go to CPU memory"
        elif total <= free["nvme"]:
            placement[item] = "nvme"
            reason[item] = (f"{what}, and CPU memory has only {human_bytes(free['cpu'])} free, "
                            f"so the group's {human_bytes(total)} go to NVMe")
        else:
            why = (f"{_NAMES[item]} need {human_bytes(total)} across dp={spec.dp} devices but only "
                   f"{human_bytes(free['cpu'])} CPU memory and {human_bytes(free['nvme'])} NVMe remain; "
                   "raise --cpu-memory/--nvme/--dp or shrink the model")
            reason[item] = f"{what}, and {why}"
            problem = problem or why
            continue
        free[placement[item]] -= total  # type: ignore[index]
    if problem is not None:
        return _not_fitting(tiles, work_reason, problem, reason, placement)
    reason["tiles"] = work_reason
    summary = ", ".join(f"{_NAMES[k]} on {placement[k]}" for k in _KEYS)
    return {**{k: placement[k] for k in _KEYS}, "tiles": tiles,
            "reason": {k: reason[k] for k in _KEYS + ("tiles",)},
            "fits": True, "recommendation": f"fits: {summary}, largest linear in {tiles} tile(s)"}


def analyze(spec: TransformerSpec, hw: Hardware | None = None) -> dict[str, Any]:
    """Evaluate the paper's memory, arithmetic-intensity and placement model.

    Byte counts are Python ints; efficiencies are floats in (0, 1).  Every
    figure is computed whether or not the model fits; ``fits`` says whether a
    placement exists and ``placement["recommendation"]`` gives it, or the reason
    it does not fit (``check_fits`` turns that into a DoesNotFitError).
    """
    hw = Hardware() if hw is None else hw
    nl, hd, bsz, seq, ci = spec.layers, spec.hidden, spec.batch, spec.seq, spec.ckpt_interval
    params = 12 * nl * hd * hd
    act_work = bsz * seq * ci * (16 * hd + 2 * spec.heads * seq)
    ckpt_bytes = _ceil_div(2 * bsz * seq * hd * nl, ci)
    ait = {
        "param_grad": seq * bsz,
        "optimizer": seq * bsz / 4,
        "activation_checkpoint": 24 * hd * ci,
    }
    bw, peak = hw.slow_bandwidth_bytes_per_s, hw.peak_flops_per_s
    aits_by_item = {"params": ait["param_grad"], "optimizer": ait["optimizer"],
                    "activation_checkpoints": ait["activation_checkpoint"]}
    placement = _place(spec, hw, params, act_work, ckpt_bytes, aits_by_item)
    return {
        "fits": placement.pop("fits"),
        "params": params,
        "model_state_bytes": MODEL_STATE_BYTES_PER_PARAM * 12 * nl * hd * hd,
        "working_memory_bytes": _ceil_div(16 * hd * hd, spec.tiles),
        "activation_working_memory_bytes": act_work,
        "activation_checkpoint_bytes": ckpt_bytes,
        "flops_per_iteration": 8 * bsz * seq * params,
        "ait_param_grad": ait["param_grad"],
        "ait_optimizer": ait["optimizer"],
        "ait_activation_checkpoint": ait["activation_checkpoint"],
        "efficiency": {k: _efficiency(v, bw, peak) for k, v in ait.items()},
        "placement": placement,
    }


def check_fits(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` of ``analyze`` if the model fits; else raise DoesNotFitError with the reason."""
    if not result["fits"]:
        raise DoesNotFitError(result["placement"]["recommendation"].removeprefix("does not fit: "))
    return result
