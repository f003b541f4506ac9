"""A unit's NVMe optimizer states packed in one file (``runtime/packed_state.py``).

The training parity of every path that uses it (streamed step, prefetch, speculation, checkpoints)
is in test_offload.py, test_optimizer_overlap.py and test_checkpoint.py; here: that the packed bytes
are eager's moments, that one file and one read serve all of a unit's states, and that a new set of
states gets a new layout.
"""

from __future__ import annotations

import copy

import torch

import zinf_compile
import zinf_runtime
from zinf_compile.models import GPT, GPTConfig, make_batch
from zinf_runtime.packed_state import Layout

CFG = GPTConfig(vocab=64, seq=16, layers=1, hidden=32, heads=4)


def _trained(tmp_path):
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    zopt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-2)
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager", "offload_optimizer": "nvme",
                                                        "nvme_path": str(tmp_path)})
    for i in range(2):
        x, y = make_batch(CFG, 4, seed=i)
        ref(x, y).backward(); ropt.step(); ropt.zero_grad()
        cm(x, y).backward(); zopt.step(); zopt.zero_grad()
    return ref, ropt, model


def test_packed_moments_are_eagers_and_one_read_serves_every_field(tmp_path):
    ref, ropt, model = _trained(tmp_path)
    p_ref, p = ref.blocks[0].fc.weight, model.blocks[0].fc.weight
    u = zinf_runtime.handle_of(p)
    ps = u.optim_state
    assert ps.names == ("exp_avg", "exp_avg_sq") and ps.nbytes == 8 * u.shard_numel
    got = ps.get()
    for name in ps.names:  # dp 1: the shard is the whole parameter, flattened
        assert torch.equal(got[name], ropt.state[p_ref][name].reshape(-1))
    engine = ps.slot.swap
    reads = engine.stats()["reads"]
    fields = ps.fields()
    views = {n: f.get_async() for n, f in fields.items()}
    for t, h in views.values():
        h.wait()
    assert engine.stats()["reads"] == reads + 1  # both fields from one read of the unit's one file
    for name, (t, _) in views.items():
        assert torch.equal(t, got[name])


def test_a_new_set_of_states_gets_a_new_layout(tmp_path):
    _, _, model = _trained(tmp_path)
    u = zinf_runtime.handle_of(model.blocks[0].fc.weight)
    ps, pool, n = u.optim_state, u.context.pool, u.shard_numel
    old_slot = ps.slot
    states = {"m": torch.arange(n, dtype=torch.float32), "count": torch.arange(n, dtype=torch.int64),
              "v": -torch.arange(n, dtype=torch.float32)}
    ps.store(states, pool)
    assert ps.names == ("m", "count", "v") and ps.slot is not old_slot and not old_slot.present
    assert ps.layout == Layout.of(states, n) and ps.nbytes == 16 * n
    got = ps.get()
    for name, v in states.items():
        assert got[name].dtype == v.dtype and torch.equal(got[name], v)
    # stepped in place in the buffer it was read into: written back from that buffer, no copy
    buf, h = ps.read_async(pool)
    h.wait()
    views = ps.views(buf)
    views["m"].add_(1)
    layout, data = ps.pack(views, pool, buf)
    assert data is buf and layout is ps.layout
    ps.store(views, pool, buf)
    assert torch.equal(ps.get()["m"], states["m"] + 1)
    ps.store({}, pool)  # no state left: no file left
    assert not ps.present and ps.names == ()
