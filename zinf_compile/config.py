"""Options of the zinf backend: ``torch.compile(m, backend="zinf", options={...})`` or ``Config(...)``.

Every option is validated up front; an unknown key or a bad value raises ``ValueError`` naming the
key, the value and the valid choices, before anything is traced or partitioned.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

_CHOICES: dict[str, tuple] = {
    "offload_params": ("none", "cpu", "nvme"),
    "offload_optimizer": ("none", "cpu", "nvme"),
    "mixed_precision": (None, "bf16", "fp16"),
    "compiler": ("inductor", "eager"),
    "partition": ("bandwidth", "broadcast"),
}


# bucket_bytes=None: one all-gather / reduce-scatter per run of small parameters of up to 8 MiB
# (the measurements are in Config's docstring)
DEFAULT_BUCKET_BYTES = 8 << 20


TIER_OF = {"none": "device", "cpu": "cpu", "nvme": "nvme"}  # option value -> the runtime's tier


@dataclass(frozen=True)
class Config:
    """Settings of one compile. Fields:

    offload_params: where each rank keeps the parameter shards that forward and backward fetch:
        ``"none"`` on the compute device, ``"cpu"`` in (pinned, with CUDA) host memory, ``"nvme"``
        in files under ``nvme_path``.
    offload_optimizer: where each rank keeps its fp32 master shards, gradient shards (moved there
        as soon as they are reduce-scattered) and optimizer state: ``"none"`` (compute device),
        ``"cpu"`` or ``"nvme"`` (stepped in sub-groups of ``optimizer_sub_group_bytes``, reading
        the next sub-group while stepping one). Every combination with ``offload_params`` works.
    nvme_path: an existing, writable directory on a fast local disk, required by either "nvme";
        each rank swaps into its own 0700 folder there, removed at exit.
    swap_block_size, swap_queue_depth, swap_buffer_count, swap_buffer_size: the swap engine's IO
        block, requests in flight (IO threads), and aligned bounce-buffer pool.
    nvme_checksum: the swap engine keeps a checksum of every block it writes and verifies it on every
        read, so a corrupted or truncated swap file raises an error naming it instead of training on
        bad bytes. It is CRC-32C from the ``google-crc32c`` package's library when installed (about
        18 GB/s per thread here), else zlib's crc32 (about 2 GB/s, which was 15% of the CPU samples of
        an NVMe step on two cores); both run in the IO threads, GIL released. False skips it.
    nvme_reuse_files: each swap key keeps two files, and a write overwrites the one not holding the
        current version (blocks already allocated: no allocation or create/rename per write, 3.3x
        faster rewrites on this project's VM, ``benchmarks/swap_rewrite.py``), at up to twice the disk
        space of keys rewritten every step; False: one file per key, each write a new file renamed
        over the old. Either way a failed write leaves the key's current version intact.
    optimizer_sub_group_bytes: state bytes (16 per parameter: master, gradient, two moments) an
        NVMe optimizer steps at a time; bounds its host memory. Also the host bytes of NVMe-bound
        gradients kept in memory for the step instead of written (``zinf_runtime.tiers.DirtyTracker``).
    nvme_min_shard_bytes: a parameter whose fp32 shard (1/dp of it) is smaller than this keeps its
        NVMe-tier states (parameter copy, master, gradient, moments) in CPU memory instead, 16 bytes
        of RAM per element: each state on NVMe is a file and a request per step, whose fixed cost
        does not shrink with its size. None (the default): 64 KiB for 1-D parameters (norms,
        biases: most of a transformer's parameters, a fraction of a percent of its bytes), every
        matrix on NVMe; an int applies to every parameter, 0 puts every parameter on NVMe
        (``zinf_runtime.Placement.for_param``; the README's Options table says what it gained).
    nvme_read_cache_bytes: with parameters on NVMe, host bytes of shards kept as clean copies of
        their files: after a fetch read them, and after the optimizer wrote them (write-through), so
        the next fetch or master read finds them instead of reading the file
        (``zinf_runtime.read_cache``). Oldest out first; 0 turns it off; a shard larger than this is
        never kept. Default 64 MiB per rank and model.
    nvme_param_write_back: with parameters on NVMe, the optimizer's stepped parameters (the fp32
        master, and the parameter copy of a bf16/fp16 model) stay in host memory as the parameter's
        value instead of being written every step; the next forward and backward fetch them there,
        and one is written only when the newest kept values exceed ``nvme_read_cache_bytes``
        (oldest first; counted apart from the read cache and from the gradients kept for the step).
        Why: a parameter file rewritten every step, and read back by the next forward, costs a write
        per step and the IO threads' CPU for bytes that are still in memory; DeepSpeed keeps its
        parameters in CPU memory up to ``max_in_cpu`` for the same reason. A full disk on an
        eviction's write keeps the value in memory and raises at the parameter's next access or at
        the step's end. ``False``: every step writes them (write-through; the read cache then keeps
        the written copies).
    mixed_precision: ``None`` trains in the model's dtype; ``"bf16"``/``"fp16"`` run the model as under
        ``torch.autocast`` with that dtype, all-gathering parameters in it where every use is a cast,
        while master weights, gradient shards and optimizer state stay fp32.
    dump_dir: if set (or env ``ZINF_DUMP_DIR``), every graph after every pass is written there as
        readable code, one folder per compiled graph; with several ``torch.distributed`` processes,
        under one ``rank<R>`` folder each.
    pass_code: keep the generated code of the graph after every pass in ``last_graphs()``, not only
        of each stage's last graph (op counts and zinf tags are kept for every pass either way). On
        whenever ``dump_dir`` or ``TORCH_TRACE`` is set; off by default because FX's code generation
        per pass cost 0.7-3 s of a 25M model's first step (``zinf_compile.pipeline``).
    process_group: the data-parallel group that shards parameters; default: the default group when
        ``torch.distributed`` is initialized, else dp = 1.
    compiler: ``"inductor"`` compiles the compute between zinf nodes with Inductor (zinf ops stay
        ordered fallback calls); ``"eager"`` runs the rewritten FX graphs as they are (debugging, tests).
    sync_module_states: with dp > 1, broadcast parameter values from the group's rank 0 before
        sharding (as DDP does), so ranks that initialised differently train one model.
    disabled_passes: names of passes to skip (debugging; a name no pass has is an error); see
        ``zinf_compile.pipeline``.
    tile_threshold_bytes: a matmul whose partitioned weight holds more bytes than this is tiled along
        its output dimension (memory-centric tiling); the default (1 GiB) leaves ordinary models alone.
    tiles: force this tile count for every matmul over the threshold (None: chosen automatically,
        ``ceil(weight bytes / tile_threshold_bytes)``, or from ``device_memory_budget``).
    device_memory_budget: bytes of materialized parameters and gradients allowed on the compute
        device. Tile counts are then chosen so each operator's working memory (weight tile + its
        gradient) fits in half of it, and the runtime raises a clear out-of-memory error, naming
        the tensor and the bytes, rather than exceed it (emulates a GPU's limit on CPU). It is this
        model's own: another model compiled in the same process keeps its own budget.
    malloc_mmap_threshold: None (default) leaves glibc's allocator alone; bytes (1..32 MiB) fix its
        mmap threshold, process-wide, when this model is compiled. glibc's dynamic threshold gives
        host buffers over 32 MiB a fresh mmap and page faults on every fetch, and keeps smaller freed
        buffers in its heap (RSS grows when streaming NVMe state); a fixed 1 MiB returns them to the
        OS (``zinf_runtime.tiers.set_malloc_mmap_threshold`` has the measurements).
    prefetch_depths: ``(nvme, upload, gather)``: how many parameter-using operators ahead of its use
        each transfer of a parameter starts (the paper's NVMe->host for i+3, host->device for i+2,
        all-gather for i+1). With buckets the gather depth also counts collectives: a bucket's
        all-gather starts no later than the first use of the bucket (or lone gather) ``gather``
        groups before it, so the next block's bucket is exchanged while this block computes
        (``passes/schedule.py``, ``_plan_group_lookahead``). ``(0, 0, 0)`` is the serial schedule:
        every transfer waits at its use.
    reduce_depths: ``(reduce, offload)``: in backward, how many gradient-producing operators later
        the reduce-scatter of a gradient, and its offload (device->host, NVMe write), are waited for.
        With buckets counted in collectives too: a bucket is waited for once the last gradient of
        the group ``reduce`` groups after it exists (``_plan_reduce_group_waits``).
    max_inflight_bytes: cap on the bytes of parameters fetched ahead of their use at any point of a
        graph (None: no cap); a prefetch that would exceed it starts later.
    bucket_bytes: coalesce the all-gathers of consecutive small parameters (dp > 1) into one collective
        of at most this many gathered bytes, and their gradients' reduce-scatters likewise (0: one
        collective per parameter). None (default): ``DEFAULT_BUCKET_BYTES`` (8 MiB) with
        ``partition="bandwidth"``, at most ``max_inflight_bytes``; 0 with ``partition="broadcast"``.
        Why on by default: at dp 2 on gloo, one collective per parameter (about 150 per pass of the
        25M GPT) is latency-bound. Interleaved in one process, 8 MiB buckets took the 25M CPU-offload
        step to 0.76x and 0.89x of unbucketed in the two runs with both; 16 MiB was the fastest variant
        in one run and 1.11x unbucketed in another,
        and 128 MiB (the whole model in one bucket, no overlap left) was slower than none
        (``benchmarks/ab_overhead.py``, README "Buckets at dp 2").
    partition: how parameters are spread over the dp ranks. ``"bandwidth"`` (default, ZeRO-Infinity's
        bandwidth-centric scheme): every rank holds 1/dp of every parameter; a use all-gathers it, a
        gradient is reduce-scattered. ``"broadcast"`` (the classic single-owner scheme, for comparison):
        each parameter has one owner rank (balanced by bytes) holding it whole on its tier; a use
        broadcasts it from the owner, a gradient is reduced to the owner, whose optimizer steps it
        (``zinf_runtime.broadcast``). Same numbers either way; checkpoints refuse "broadcast".
    trace: a path: write a Chrome/Perfetto trace (JSON) of the transfers and compute of one step
        there (``zinf_runtime.transfer``).
    trace_step: which step ``trace`` records, counted from 0 and ended by each optimizer step (default
        1, the step after the one that compiles). With an NVMe tier, step 1 still creates the second
        file of each rewritten key and steps 0-1 run without the optimizer's prefetch (it attaches at
        the first step): 2 or later shows the steady state.
    optimizer_prefetch: with the optimizer on NVMe, start reading a unit's master and moments (and
        keep its final gradient in memory) during backward, as soon as its gradient is final, up to
        ``optimizer_sub_group_bytes`` held; ``step()`` uses them if nothing changed since
        (``zinf_runtime.optim_overlap``). It moves reads into backward, where they share the disk
        with backward's parameter reads, and saves the gradient re-read; whether that pays on a given
        disk is measured by ``benchmarks/overlap.py --optimizer-prefetch on|off`` (on this VM the
        runs disagreed within its noise, README, Measured).
    overlap_optimizer_step: step a unit whose gradient is final in a background thread while
        backward goes on (optimizer on ``cpu`` or ``nvme``); ``step()`` commits what is still valid
        (same gradient, state and hyper-parameters: clipping, accumulation, lr changes roll back to
        the ordinary step), so the numbers are exactly those of stepping after backward.
    """

    offload_params: str = "none"
    offload_optimizer: str = "none"
    nvme_path: Optional[str] = None
    swap_block_size: int = 1 << 20
    swap_queue_depth: int = 8
    swap_buffer_count: int = 4
    swap_buffer_size: int = 64 << 20
    nvme_checksum: bool = True
    nvme_reuse_files: bool = True
    optimizer_sub_group_bytes: int = 256 << 20
    nvme_min_shard_bytes: Optional[int] = None
    nvme_read_cache_bytes: int = 64 << 20
    nvme_param_write_back: bool = True
    mixed_precision: Optional[str] = None
    dump_dir: Optional[str] = field(default_factory=lambda: os.environ.get("ZINF_DUMP_DIR") or None)
    pass_code: bool = False
    process_group: Optional[Any] = None
    compiler: str = "inductor"
    sync_module_states: bool = True
    disabled_passes: tuple[str, ...] = ()
    tile_threshold_bytes: int = 1 << 30
    tiles: Optional[int] = None
    device_memory_budget: Optional[int] = None
    malloc_mmap_threshold: Optional[int] = None
    prefetch_depths: tuple[int, int, int] = (3, 2, 1)
    reduce_depths: tuple[int, int] = (1, 2)
    max_inflight_bytes: Optional[int] = None
    bucket_bytes: Optional[int] = None
    trace: Optional[str] = None
    trace_step: int = 1
    partition: str = "bandwidth"
    optimizer_prefetch: bool = True
    overlap_optimizer_step: bool = False

    def __post_init__(self) -> None:
        for key, choices in _CHOICES.items():
            value = getattr(self, key)
            if value not in choices:
                raise ValueError(
                    f"zinf option {key!r}: invalid value {value!r}; valid choices: {list(choices)}"
                )
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ValueError(f"zinf option 'dump_dir': expected a path string, got {self.dump_dir!r}")
        if not isinstance(self.sync_module_states, bool):
            raise ValueError(
                f"zinf option 'sync_module_states': expected True or False, got {self.sync_module_states!r}"
            )
        if isinstance(self.disabled_passes, str) or not all(
            isinstance(p, str) for p in self.disabled_passes
        ):
            raise ValueError(
                f"zinf option 'disabled_passes': expected a tuple of pass names, got {self.disabled_passes!r}"
            )
        object.__setattr__(self, "disabled_passes", tuple(self.disabled_passes))
        from .backend import pass_names  # the pipeline's own lists (imported here: backend imports Config)

        unknown = [p for p in self.disabled_passes if p not in pass_names()]
        if unknown:
            raise ValueError(f"zinf option 'disabled_passes': unknown pass name(s) {unknown}; "
                             f"the passes are {sorted(pass_names())}")
        if "nvme" in (self.offload_params, self.offload_optimizer):
            self._check_nvme_path()
        if not isinstance(self.optimizer_sub_group_bytes, int) or self.optimizer_sub_group_bytes <= 0:
            raise ValueError(f"zinf option 'optimizer_sub_group_bytes': invalid value "
                             f"{self.optimizer_sub_group_bytes!r}; expected a positive int")
        for key, minimum, optional in (("tile_threshold_bytes", 0, False), ("nvme_min_shard_bytes", 0, True),
                                       ("nvme_read_cache_bytes", 0, False), ("tiles", 1, True), ("device_memory_budget", 1, True)):
            value = getattr(self, key)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"zinf option {key!r}: invalid value {value!r}; expected an int >= {minimum}"
                                 + (" or None" if optional else ""))
        for key, n in (("prefetch_depths", 3), ("reduce_depths", 2)):
            value = getattr(self, key)
            if (not isinstance(value, (tuple, list)) or len(value) != n
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
                raise ValueError(f"zinf option {key!r}: invalid value {value!r}; expected {n} ints >= 0, "
                                 f"e.g. {(3, 2, 1) if n == 3 else (1, 2)}")
            object.__setattr__(self, key, tuple(value))
        for key in ("max_inflight_bytes", "bucket_bytes"):
            value = getattr(self, key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"zinf option {key!r}: invalid value {value!r}; expected an int of bytes >= 0 "
                                 "or None")
        if self.bucket_bytes and self.partition == "broadcast":
            raise ValueError(f"zinf option 'bucket_bytes': {self.bucket_bytes!r} coalesces the all-gathers and "
                             "reduce-scatters of partition='bandwidth'; partition='broadcast' broadcasts each "
                             "parameter from its owner instead. Leave bucket_bytes 0 with it")
        if self.bucket_bytes and self.max_inflight_bytes is not None and self.bucket_bytes > self.max_inflight_bytes:
            raise ValueError(f"zinf option 'bucket_bytes': {self.bucket_bytes!r} is over max_inflight_bytes "
                             f"({self.max_inflight_bytes!r}); a bucket's members are all in flight at once, so "
                             "make it at most the cap")
        for key in ("optimizer_prefetch", "overlap_optimizer_step", "pass_code", "nvme_param_write_back"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"zinf option {key!r}: expected True or False, got {getattr(self, key)!r}")
        if self.trace is not None and not isinstance(self.trace, (str, os.PathLike)):
            raise ValueError(f"zinf option 'trace': expected a file path, got {self.trace!r}")
        if isinstance(self.trace_step, bool) or not isinstance(self.trace_step, int) or self.trace_step < 0:
            raise ValueError(f"zinf option 'trace_step': expected an int >= 0 (the step to record, counted from "
                             f"0), got {self.trace_step!r}")
        mmap_max = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
        value = self.malloc_mmap_threshold
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= mmap_max):
            raise ValueError(f"zinf option 'malloc_mmap_threshold': invalid value {value!r}; expected None or an "
                             f"int of bytes in 1..{mmap_max} (glibc's limit), e.g. {1 << 20}")
        if self.process_group is not None:
            import torch.distributed as dist

            if not isinstance(self.process_group, dist.ProcessGroup):
                raise ValueError(
                    f"zinf option 'process_group': expected a torch.distributed.ProcessGroup or None, "
                    f"got {type(self.process_group).__name__}"
                )

    def _check_nvme_path(self) -> None:
        path = self.nvme_path
        if not path:
            raise ValueError("zinf option 'nvme_path' is required with offload_params/offload_optimizer='nvme'; "
                             "set it to an existing, writable directory on a fast local disk")
        if not os.path.isdir(path):
            raise ValueError(f"zinf option 'nvme_path': {path!r} is not an existing directory; create it "
                             f"(mkdir -p {path}) or point nvme_path at one")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"zinf option 'nvme_path': {path!r} is not writable; fix its permissions or "
                             "choose another directory")
        self.swap_config()  # validates the swap settings, naming the bad one

    def placement(self, device: torch.device, context: Optional[Any] = None) -> Any:
        """The runtime's ``Placement`` for parameters computed on ``device`` (one place for the backend,
        ``zinf_compile.init`` and checkpoint loading, so a model's graphs agree on it)."""
        import zinf_runtime

        return zinf_runtime.Placement(
            tier=TIER_OF[self.offload_params], compute_device=device, group=self.resolved_group(),
            optim_tier=TIER_OF[self.offload_optimizer], swap=self.swap_config(),
            sub_group_bytes=self.optimizer_sub_group_bytes, partition=self.partition,
            nvme_min_bytes=self.nvme_min_shard_bytes, read_cache_bytes=self.nvme_read_cache_bytes,
            param_write_back=self.nvme_param_write_back, context=context)

    def swap_config(self) -> Any:
        """The runtime's swap settings (None without an NVMe tier)."""
        if "nvme" not in (self.offload_params, self.offload_optimizer):
            return None
        from zinf_runtime.swap import SwapConfig

        try:
            return SwapConfig(nvme_path=os.path.abspath(str(self.nvme_path)), block_size=self.swap_block_size,
                              queue_depth=self.swap_queue_depth, buffer_count=self.swap_buffer_count,
                              buffer_size=self.swap_buffer_size, checksum=self.nvme_checksum,
                              reuse_files=self.nvme_reuse_files)
        except ValueError as e:  # name our option, not the runtime's field
            text = str(e).replace("SwapConfig.checksum", "nvme_checksum").replace(
                "SwapConfig.reuse_files", "nvme_reuse_files").replace("SwapConfig.", "swap_")
            raise ValueError(f"zinf swap option: {text}") from None

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]] = None) -> "Config":
        """Build from a ``torch.compile`` options dict (or pass a ``Config`` through)."""
        if options is None:
            return cls()
        if isinstance(options, Config):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(f"zinf options must be a dict or zinf_compile.Config, got {type(options).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                raise ValueError(
                    f"zinf option {key!r} (value {options[key]!r}) is unknown; valid options: {names}"
                )
        return cls(**dict(options))

    @property
    def bucket_limit(self) -> int:
        """The gathered bytes one bucket may hold (0: no buckets): ``bucket_bytes``, or when it is None
        the default, which stays under ``max_inflight_bytes`` and is 0 with ``partition="broadcast"``."""
        if self.bucket_bytes is not None:
            return self.bucket_bytes
        if self.partition == "broadcast":
            return 0
        cap = self.max_inflight_bytes
        return DEFAULT_BUCKET_BYTES if cap is None else min(DEFAULT_BUCKET_BYTES, cap)

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.mixed_precision]

    def resolved_group(self) -> Optional[Any]:
        """The process group to shard over, or None for dp = 1 / the default group."""
        return self.process_group
