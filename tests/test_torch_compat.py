"""The private torch APIs zinf relies on, each exercised through its one wrapper."""

from __future__ import annotations

import torch
import torch.fx

from zinf_compile import _torch_compat as tc


def test_must_recompute_tag_is_the_checkpoint_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    assert tc.must_recompute_tag() is CheckpointPolicy.MUST_RECOMPUTE


def test_aot_autograd_with_partition_fn_and_boxed_compilers():
    seen = {}

    def partition(joint, inputs, **kw):
        seen["joint"] = any(n.name.startswith("tangents") for n in joint.graph.nodes)
        return tc.min_cut_partition(joint, inputs, **kw)

    def compiler(name):
        def c(gm, ex):
            seen[name] = True
            return tc.make_boxed(gm)
        return c

    backend = tc.aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"), partition_fn=partition)
    lin = torch.nn.Linear(3, 2)
    f = torch.compile(lin, backend=backend)
    x = torch.randn(4, 3)
    f(x).sum().backward()
    assert seen == {"joint": True, "fw": True, "bw": True}
    assert lin.weight.grad is not None


def test_inductor_patches_scope_the_joint_pass_and_cache_setting():
    import torch._functorch.config as fc
    import torch._inductor.config as ic

    calls = []
    p = tc.custom_graph_pass(lambda g: calls.append(g), uuid="zinf-test")
    before = (ic.joint_custom_pre_pass, fc.enable_autograd_cache)
    with ic.patch({"triton.cudagraphs": True}), tc.inductor_patches(p):  # a user's global setting
        assert ic.triton.cudagraphs is False
        assert ic.joint_custom_pre_pass is p and fc.enable_autograd_cache is False
        assert fc.force_non_lazy_backward_lowering is True
        assert p.uuid() == "zinf-test"
        g = torch.fx.Graph()
        p(g)
    assert (ic.joint_custom_pre_pass, fc.enable_autograd_cache) == before
    assert calls == [g]


def test_inductor_compile_fx_calls_inner_compile_per_stage():
    stages = []

    def inner(gm, ex, **kw):
        stages.append("backward" if kw.get("is_backward") else "forward")
        return tc.inductor_compile_fx_inner(gm, ex, **kw)

    def backend(gm, ex):
        return tc.inductor_compile_fx(gm, ex, inner_compile=inner)

    import torch._functorch.config as fc

    lin = torch.nn.Linear(3, 2)
    with fc.patch(enable_autograd_cache=False):  # a cache hit would skip inner_compile
        torch.compile(lin, backend=backend)(torch.randn(2, 3)).sum().backward()
    assert stages == ["forward", "backward"]


def test_eager_patches_compile_the_backward_with_the_forward():
    """``force_non_lazy_backward_lowering``: the backward compiler runs inside the compile (where zinf
    can still fall back), not at the first ``backward()``; without the patch AOTAutograd defers it."""
    import torch._functorch.config as fc

    def run(patched: bool) -> list:
        seen = []

        def compiler(name):
            def c(gm, ex):
                seen.append(name)
                return tc.make_boxed(gm)
            return c

        backend = tc.aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
        torch._dynamo.reset()
        f = torch.compile(torch.nn.Linear(3, 2), backend=backend)
        if patched:
            with tc.eager_patches():
                assert fc.force_non_lazy_backward_lowering is True
                out = f(torch.randn(4, 3))
        else:
            out = f(torch.randn(4, 3))
        before_backward = list(seen)
        out.sum().backward()
        return before_backward

    assert run(patched=False) == ["fw"]
    assert run(patched=True) == ["fw", "bw"]
    assert fc.force_non_lazy_backward_lowering is False  # scoped to the compile


def test_storage_key_shared_by_aliases_and_stable_across_resize():
    from zinf_compile import _torch_compat

    p = torch.nn.Parameter(torch.randn(4, 3))
    key = _torch_compat.storage_key(p)
    assert _torch_compat.storage_key(p[1:]) == key and _torch_compat.storage_key(p.data) == key
    p.untyped_storage().resize_(0)
    assert _torch_compat.storage_key(p) == key
    assert _torch_compat.storage_key(torch.randn(4, 3)) != key


def test_is_dynamo_restart():
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    assert tc.is_dynamo_restart(TensorifyScalarRestartAnalysis())
    assert not tc.is_dynamo_restart(RuntimeError("x"))


def test_default_store_is_the_process_groups_store(tmp_path):
    import torch.distributed as dist

    assert tc.default_store() is None  # no process group yet
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        store = tc.default_store()
        store.set("zinf/probe", "x")
        assert store.check(["zinf/probe"]) and store.get("zinf/probe") == b"x"
        assert store.compare_set("zinf/first", "", "a") == b"a"
        assert store.compare_set("zinf/first", "", "b") == b"a"  # the first value posted stays
    finally:
        dist.destroy_process_group()


def test_state_dict_detaches_each_parameter_from_save_to_state_dict():
    """``runtime/eager_access.py`` serves ``param.detach()`` with the full value only when its caller's
    frame runs ``Module._save_to_state_dict`` (torch internals the runtime cannot reach through this
    file, which it never imports): pin that ``state_dict()`` still calls it so, through
    ``__torch_function__``, and that ``DisableTorchFunctionSubclass`` turns the override off."""
    import sys

    seen = []

    class Probe(torch.nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.detach:
                seen.append(sys._getframe(1).f_code)
            return super().__torch_function__(func, types, args, kwargs or {})

    m = torch.nn.Linear(2, 2)
    m.weight.__class__ = Probe
    m.state_dict()
    assert seen == [torch.nn.Module._save_to_state_dict.__code__]
    with torch._C.DisableTorchFunctionSubclass():
        m.weight.detach()
    assert len(seen) == 1


def _as_on_torch_2_11(monkeypatch) -> None:
    """torch 2.11 holds ``is_compiling()`` True only inside Dynamo-traced code; 2.13 holds it for the
    whole compile session through this context manager, so making it a no-op gives 2.11's behaviour."""
    import contextlib

    if hasattr(torch.compiler, "_compile_session_context"):
        monkeypatch.setattr(torch.compiler, "_compile_session_context", contextlib.nullcontext)


def test_in_compile_session_holds_for_the_whole_compilation_on_every_version(monkeypatch):
    from torch._guards import CompileContext

    _as_on_torch_2_11(monkeypatch)
    seen = {}

    def backend(gm, example_inputs):
        seen["session"] = tc.in_compile_session()
        seen["is_compiling"] = torch.compiler.is_compiling()
        seen["compile_context"] = CompileContext.try_get() is not None  # the private API it reads
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(3))
    assert seen == {"session": True, "is_compiling": False, "compile_context": True}
    assert not tc.in_compile_session()


def test_a_model_built_partitioned_compiles_on_torch_2_11(monkeypatch):
    """On the lent H200 (torch 2.11) Dynamo's ``describe_tensor`` called ``is_conj()`` on a parameter
    that ``zinf_compile.init`` had partitioned, outside traced code, and the eager-read guard refused it."""
    import zinf_compile
    from zinf_compile.models import GPT, GPTConfig

    _as_on_torch_2_11(monkeypatch)
    torch._dynamo.reset()
    cfg = GPTConfig(vocab=64, seq=16, layers=1, hidden=32, heads=4)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    with zinf_compile.init(offload_params="cpu", offload_optimizer="cpu", compiler="eager") as zi:
        model = GPT(cfg)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    loss = torch.compile(model, backend="zinf", options=zi.options)(x, y)
    torch.testing.assert_close(loss, ref(x, y), rtol=1e-6, atol=1e-6)
    with torch.no_grad(), __import__("pytest").raises(zinf_compile.PartitionedDataError):
        next(model.parameters()).sum()  # eager reads are still refused outside a compilation


def test_structured_trace_enabled_only_with_a_trace_folder(tmp_path):
    from torch._logging._internal import LazyTraceHandler, trace_log

    saved = list(trace_log.handlers)
    try:
        for h in saved:
            trace_log.removeHandler(h)
        assert not tc.structured_trace_enabled()
        trace_log.addHandler(LazyTraceHandler(None))  # torch's default without TORCH_TRACE: drops itself
        assert not tc.structured_trace_enabled()
        trace_log.addHandler(LazyTraceHandler(str(tmp_path)))  # TORCH_TRACE=dir
        assert tc.structured_trace_enabled()
    finally:
        for h in list(trace_log.handlers):
            trace_log.removeHandler(h)
        for h in saved:
            trace_log.addHandler(h)


def test_ddp_ignore_is_what_ddp_and_its_copies_read():
    """The list lands where DistributedDataParallel's constructor (and Lightning's state sync) look."""
    m = torch.nn.Linear(2, 2)
    tc.ddp_ignore(m, ["weight"])
    assert set(m._ddp_params_and_buffers_to_ignore) == {"weight"}
    tc.ddp_ignore(m, [])  # a later call replaces the list
    assert list(m._ddp_params_and_buffers_to_ignore) == []
