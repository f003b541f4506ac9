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
    with tc.inductor_patches(p):
        assert ic.joint_custom_pre_pass is p and fc.enable_autograd_cache is False
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
