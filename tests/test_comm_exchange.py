"""On gloo, zinf's all-gathers and reduce-scatters run as exchanges (``zinf_runtime.comm.exchanges``):
one ``all_to_all_single`` each (a replicated shard out; or each rank's slice out and a local sum in
rank order; at 2 ranks, with no chunk to itself), faster there than gloo's own collectives. They must give torch's collectives' numbers:
an all-gather bit for bit; a reduce-scatter bit for bit at 2 ranks on any floats (``a + b == b + a``),
on integer-valued floats (exact sums in any order) at 3, and within the rounding of two summation
orders otherwise; sync and started-then-waited alike, with the wait sliced for failure polling
while a peer is late."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest


def _run(tmp_path, world: int) -> list:
    out = tmp_path / f"exchange{world}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
           "127.0.0.1", "--master-port", str(port),
           os.path.join(os.path.dirname(__file__), "workers", "comm_exchange.py"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", ZINF_FAILURE_POLL_S="0.2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_exchange_matches_gloo(tmp_path, world):
    rows = _run(tmp_path, world)
    assert len(rows) == world
    for r in rows:
        assert r["world"] == world and len(r["cases"]) == 6
        for c in r["cases"]:
            assert c["exchanges"] and c["input_untouched"], c
            if world == 2 or c["kind"] == "integer":
                assert c["sync_equal"] and c["async_equal"], c
            else:  # 3 ranks, any floats: torch's ring may sum in another order
                assert c["within_rounding"], c
        assert r["gather"] == [{"sync_equal": True, "async_equal": True, "packed_equal": True, "then": 1}] * 3, r["gather"]
        assert r["late_equal"], r
        assert "receive buffer" in r["bad_recv"] and "3" in r["bad_recv"], r["bad_recv"]
        # 2 ranks: no chunk to itself (the peer's slice received, the shard sent from the output's row)
        assert (r["recv_numel"], r["send_numel"]) == ((8, 0) if world == 2 else (world * 8, world * 8)), r
    assert max(r["late_waited_s"] for r in rows) >= 0.6  # some rank's wait outlived several 0.2 s slices

