"""``zinf_compile.init``: build a model straight into the parameter store, one submodule at a time.

Without it the whole model must exist in memory before ``torch.compile`` partitions it; inside it,
each module's parameters are partitioned the moment that module's ``__init__`` returns::

    with zinf_compile.init(offload_params="nvme", nvme_path="/nvme") as zi:
        model = GPT(cfg)          # Block 0 built whole -> partitioned; Block 1 built whole -> ...
    cmodel = torch.compile(model, backend="zinf", options=zi.options)   # uses the shards as they are

    before: GPT(cfg) -> every parameter whole in host memory, then partitioned at the first call
    after:  at most one submodule whole at a time; p.untyped_storage() -> 0 bytes when GPT() returns

How (no torch internals are patched):

- the ``__init__`` of every ``nn.Module`` subclass loaded when the block is entered is wrapped, for
  the block only, so the end of a module's construction is seen; its own parameters (and any
  registered meanwhile, seen through torch's public parameter-registration hook) are partitioned
  then. A class without a wrapped ``__init__`` (defined inside the block) gets its parameters
  partitioned when they are registered;
- initializers that run after a submodule was partitioned (a parent re-initializing its children,
  as GPT-2 does, weight tying) would write 0-byte storage: a ``TorchFunctionMode`` active in the
  block sees every torch call that touches a partitioned parameter (or an alias of it), gathers
  that one parameter back for the call, and writes it back to its shards afterwards;
- models built on the ``meta`` device (torchtitan's way) are materialized by :meth:`ZinfInit.materialize`
  one module at a time: its own tensors allocated (``to_empty`` of that module alone), initialized
  (its ``reset_parameters``, or the ``init_fn`` given), partitioned, freed::

      with zinf_compile.init(offload_params="nvme", nvme_path="/nvme") as zi:
          with torch.device("meta"):
              model = GPT(cfg)        # no memory: shapes only
          zi.materialize(model)       # tok: allocate, reset, partition; pos: ...; blocks.0.qkv: ...

- random init is the module's own, in construction order and on the same RNG as eager code, so the
  same seed gives the same values. With dp > 1 each rank runs the same init and keeps its shard; no
  broadcast is needed, which is checked once: ranks whose RNG states differ get rank 0's values by
  broadcast (``sync_module_states``, the default) or an error.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
import weakref
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

import zinf_runtime
from zinf_runtime import comm
from zinf_runtime.context import RuntimeContext

from . import _torch_compat
from .config import Config


# torch calls that read only a tensor's metadata: no need to gather a partitioned parameter for them
_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.storage_offset,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.untyped_storage, torch.Tensor.__hash__,
    torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.requires_grad_, torch.Tensor.nelement,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device,
} | {getattr(torch.Tensor, a).__get__ for a in (
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "layout", "is_cuda",
    "is_meta", "_version", "is_sparse", "is_quantized", "is_nested", "_base",
)} | {torch.Tensor.requires_grad.__set__, torch.Tensor.grad.__set__}


def _rng_digest(device: torch.device) -> int:
    state = torch.random.get_rng_state()
    crc = zlib.crc32(state.numpy().tobytes())
    if device.type == "cuda":
        crc = zlib.crc32(torch.cuda.get_rng_state(device).numpy().tobytes(), crc)
    return crc


class _Frame:
    """One module whose ``__init__`` is running, and parameters registered meanwhile."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.pending: List[Tuple[torch.nn.Module, str]] = []


class _Touch(TorchFunctionMode):
    """Gathers a partitioned parameter for a torch call that reads or writes it; writes it back after."""

    def __init__(self, owner: "ZinfInit"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        reg = self.owner._registry
        if not reg or func in _METADATA:
            return func(*args, **kwargs)
        touched: List[Tuple[torch.nn.Parameter, Any, int]] = []
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            p = reg.get(_torch_compat.storage_key(t))
            if p is None or p.untyped_storage().nbytes() or any(p is q for q, _, _ in touched):
                continue
            if func == torch.Tensor.data.__set__:
                raise RuntimeError(
                    f"zinf.init: `.data = ...` on partitioned parameter {zinf_runtime.handle_of(p).name!r}; "
                    "write its values with `with torch.no_grad(): p.copy_(value)` instead")
            h = zinf_runtime.handle_of(p)
            full = h.full_data(p.dtype).view(p.shape)
            p.untyped_storage().resize_(full.numel() * full.element_size())
            with torch.no_grad():
                p.copy_(full)
            del full
            touched.append((p, h, p._version))
        try:
            return func(*args, **kwargs)
        finally:
            for p, h, version in touched:
                if p._version != version:  # written: the shards take the new values
                    h.load_full(p.detach())
                p.untyped_storage().resize_(0)
            if touched:  # init reads each parameter back once: pooled NVMe read buffers would only sit idle
                self.owner.context.pool.clear()


class ZinfInit:
    """The ``with zinf_compile.init(...)`` block; see the module docstring. ``options`` is the
    ``torch.compile(..., options=...)`` dict matching where the parameters were put."""

    _active: Optional["ZinfInit"] = None

    def __init__(self, *, device: Any = None, dtype: Optional[torch.dtype] = None, progress: Optional[bool] = None,
                 **options: Any):
        self.config = Config.from_options(options)
        self._options = dict(options)
        dev = torch.device(device) if device is not None else torch.get_default_device()
        self.device = torch.empty(0, device=dev).device if dev.type != "meta" else dev  # "cuda" -> "cuda:0"
        if self.device.type == "meta":
            raise ValueError("zinf.init: device='meta' has nowhere to put the shards; name the compute device "
                             "(e.g. 'cuda' or 'cpu'). init already keeps only one submodule whole at a time.")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"zinf.init: dtype must be a floating torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.context = RuntimeContext(name="zinf.init model")
        cfg = self.config
        self.placement = cfg.placement(self.device, context=self.context)
        self.progress = progress
        self._stack: List[_Frame] = []
        self._registry: Dict[int, torch.nn.Parameter] = {}
        self._patched: List[Tuple[type, Any]] = []
        self._undo: List[Any] = []
        self._broadcast = False
        self._meta: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # modules holding meta parameters
        self._bar: Any = None
        self.partitioned = 0  # parameters partitioned by this block
        self.partitioned_bytes = 0
        self.seconds = 0.0

    @property
    def options(self) -> Dict[str, Any]:
        """A fresh options dict for ``torch.compile(model, backend="zinf", options=...)``."""
        return dict(self._options)

    # -- entering and leaving ----------------------------------------------------------------
    def __enter__(self) -> "ZinfInit":
        if ZinfInit._active is not None:
            raise RuntimeError("zinf.init: already inside a zinf_compile.init() block; blocks do not nest")
        group = self.placement.group
        if comm.world_size(group) > 1:  # same seed on every rank -> same init -> no broadcast needed
            digests: List[Any] = [None] * comm.world_size(group)
            torch.distributed.all_gather_object(digests, _rng_digest(self.device), group=group)
            if len(set(digests)) > 1:
                if not self.config.sync_module_states:
                    raise RuntimeError(
                        f"zinf.init: the ranks' random states differ ({digests}), so their initial parameters "
                        "would too; call torch.manual_seed(<same seed>) on every rank before init, or leave "
                        "sync_module_states=True to take rank 0's values")
                self._broadcast = True
        if self.config.malloc_mmap_threshold is not None:  # as the backend does when compiling (an option)
            from zinf_runtime import tiers

            tiers.set_malloc_mmap_threshold(self.config.malloc_mmap_threshold)
        from tqdm.auto import tqdm

        show = self.progress if self.progress is not None else self.placement.tier == "nvme"
        self._bar = tqdm(desc="zinf.init: partitioning", unit="B", unit_scale=True, delay=2.0, disable=not show,
                         leave=False)
        self._t0 = time.perf_counter()
        ZinfInit._active = self
        try:
            self._patch_classes()
            self._undo.append(torch.nn.modules.module.register_module_parameter_registration_hook(self._registered))
            self._mode = _Touch(self)
            self._mode.__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None:
                for f in self._stack:  # only after an error inside a constructor
                    self._partition_frame(f)
                left = [(m, n) for m in list(self._meta) for n, p in m._parameters.items()
                        if p is not None and p.device.type == "meta"]
                if left:
                    warnings.warn(
                        f"zinf.init: {len(left)} parameters built on the meta device were not materialized "
                        f"(e.g. {type(left[0][0]).__name__}.{left[0][1]}); call zi.materialize(model) (inside "
                        "the block or after it) to allocate, initialize and partition them one module at a time",
                        stacklevel=2)
        finally:
            self._mode.__exit__(*exc)
            self._restore()
            self.seconds = time.perf_counter() - self._t0

    def _restore(self) -> None:
        for cls, orig in reversed(self._patched):
            type.__setattr__(cls, "__init__", orig)
        self._patched.clear()
        for h in self._undo:
            h.remove()
        self._undo.clear()
        self._registry.clear()
        self._stack.clear()
        if self._bar is not None:
            self._bar.close()
        ZinfInit._active = None

    def _patch_classes(self) -> None:
        seen, todo = set(), [torch.nn.Module]
        while todo:
            for sub in todo.pop().__subclasses__():
                if sub in seen:
                    continue
                seen.add(sub)
                todo.append(sub)
                orig = sub.__dict__.get("__init__")
                if inspect.isfunction(orig):
                    type.__setattr__(sub, "__init__", self._wrap(orig))
                    self._patched.append((sub, orig))

    def _wrap(self, orig: Any) -> Any:
        @functools.wraps(orig)
        def __init__(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            if ZinfInit._active is not self or (self._stack and self._stack[-1].module is module):
                return orig(module, *args, **kwargs)  # super().__init__() of a module already tracked
            frame = _Frame(module)
            self._stack.append(frame)
            try:
                orig(module, *args, **kwargs)
            finally:
                self._stack.pop()
            self._partition_frame(frame)

        return __init__

    def _registered(self, module: torch.nn.Module, name: str, param: Optional[torch.nn.Parameter]) -> None:
        """torch's parameter-registration hook: partition later if a constructor is running, else now."""
        if param is None:
            return
        if self._stack:
            self._stack[-1].pending.append((module, name))
        else:  # registered after construction (or by a class whose __init__ is not wrapped)
            module._parameters[name] = param  # the hook runs before torch stores it
            self._partition(module, name)

    # -- partitioning ------------------------------------------------------------------------
    def _partition_frame(self, frame: _Frame) -> None:
        for name in list(frame.module._parameters):
            self._partition(frame.module, name)
        for module, name in frame.pending:
            self._partition(module, name)

    def _partition(self, module: torch.nn.Module, name: str, label: Optional[str] = None) -> None:
        p = module._parameters.get(name)
        if p is None or zinf_runtime.handle_of(p) is not None:
            return
        label = label or f"{type(module).__name__}.{name}"
        if p.device.type == "meta":  # shapes only: materialize() allocates, initializes and partitions it
            self._meta.add(module)
            return
        with torch.no_grad():
            if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
            if p.device != self.device:
                p.data = p.data.to(self.device)
        nbytes = p.numel() * p.element_size()
        zinf_runtime.partition([(label, p)], self.placement, sync_from_rank0=self._broadcast)
        self._registry[_torch_compat.storage_key(p)] = p
        self.partitioned += 1
        self.partitioned_bytes += nbytes
        self._bar.update(nbytes)


    # -- meta-device models ------------------------------------------------------------------
    def materialize(self, model: torch.nn.Module, init_fn: Optional[Callable[[torch.nn.Module], None]] = None,
                    ) -> torch.nn.Module:
        """Allocate, initialize and partition a model built on the ``meta`` device, one module at a time.

        Modules are visited in ``model.modules()`` order (construction order for ordinary models). For
        each one holding meta tensors of its own: they are allocated on ``device`` (``to_empty`` of that
        module alone), initialized, and its parameters partitioned before the next module is touched, so
        at most one module's parameters exist whole. Initialization is the module's ``reset_parameters()``
        (what its constructor ran: the same seed gives eager construction's values), or ``init_fn(module)``
        for every module when given (torchtitan's ``init_weights``; eager equivalent: ``init_fn`` applied
        to ``model.modules()`` in order after the same seed). A tied parameter (the same meta Parameter in
        two modules) is allocated once; a later module's ``reset_parameters`` initializes a throwaway copy,
        as its constructor did before the weight was tied, while ``init_fn`` sees the tied parameter itself.
        Meta buffers are allocated uninitialized unless the initializer sets them. Returns ``model``.
        """
        if ZinfInit._active is not self:  # after the block: re-enter it for the walk
            with self:
                return self.materialize(model, init_fn)
        done: Dict[int, torch.nn.Parameter] = {}  # id(meta Parameter) -> its materialized Parameter
        for prefix, mod in model.named_modules(remove_duplicate=True):
            fresh, tied = [], []
            for n, p in list(mod._parameters.items()):
                if p is None or p.device.type != "meta":
                    continue
                if id(p) in done:
                    tied.append(n)
                    mod._parameters[n] = done[id(p)]
                    continue
                new = torch.nn.Parameter(torch.empty_like(p, device=self.device), requires_grad=p.requires_grad)
                done[id(p)] = new
                mod._parameters[n] = new  # plain assignment: no registration hook, partitioned below
                fresh.append(n)
            bufs = [n for n, b in mod._buffers.items() if b is not None and b.device.type == "meta"]
            for n in bufs:
                mod._buffers[n] = torch.empty_like(mod._buffers[n], device=self.device)
            if init_fn is not None:
                init_fn(mod)
            elif (fresh or bufs or tied) and callable(getattr(mod, "reset_parameters", None)):
                kept = {n: mod._parameters[n] for n in tied}
                for n in tied:  # the constructor initialized its own tensor, tied only afterwards
                    mod._parameters[n] = torch.nn.Parameter(  # torch.empty: shapes only, nothing gathered
                        torch.empty(kept[n].shape, dtype=kept[n].dtype, device=self.device), requires_grad=False)
                try:
                    mod.reset_parameters()
                finally:
                    mod._parameters.update(kept)
            for n in fresh:
                self._partition(mod, n, f"{prefix}.{n}" if prefix else n)
            self._meta.discard(mod)
        return model

def init(offload_params: str = "none", nvme_path: Optional[str] = None, device: Any = None,
         dtype: Optional[torch.dtype] = None, process_group: Any = None, offload_optimizer: str = "none",
         progress: Optional[bool] = None, **options: Any) -> ZinfInit:
    """``with zinf_compile.init(...) as zi:`` builds modules straight into the parameter store.

    ``offload_params``/``offload_optimizer``/``nvme_path``/``process_group`` (and any other
    ``torch.compile`` option, in ``options``) mean what they mean for the backend; compile the model
    with ``options=zi.options`` (or equal options: a different placement is an error naming both).
    ``device`` is the compute device (default: torch's default device), ``dtype`` the parameters'
    dtype (default: as constructed; eager equivalent ``model.to(dtype)``). ``progress``: a tqdm bar
    (shown after 2 s; default on for NVMe).
    """
    opts: Dict[str, Any] = dict(offload_params=offload_params, offload_optimizer=offload_optimizer, **options)
    if nvme_path is not None:
        opts["nvme_path"] = nvme_path
    if process_group is not None:
        opts["process_group"] = process_group
    return ZinfInit(device=device, dtype=dtype, progress=progress, **opts)
