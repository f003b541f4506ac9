"""``zinf inspect`` on a real dump, and the logging / structured-trace hooks of the pass runner."""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zinf_compile
from zinf_compile import cli
from zinf_compile.inspect import explain_node, format_diff, format_graph, format_list, load
from zinf_compile.models import GPT, GPTConfig, make_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    torch._dynamo.reset()
    d = str(tmp_path_factory.mktemp("dump"))
    cfg = GPTConfig(vocab=64, seq=16, layers=1, hidden=32, heads=4)
    # parameters on NVMe: their fetches move bytes, so the schedule pass splits them (start + wait)
    cm = torch.compile(GPT(cfg), backend="zinf", options={"compiler": "eager", "dump_dir": d, "offload_params": "nvme",
                                                          "nvme_path": str(tmp_path_factory.mktemp("nvme"))})
    cm(*make_batch(cfg, 2, seed=0)).backward()
    yield d, zinf_compile.compile_records()[-1]
    torch._dynamo.reset()


def _run_cli(capsys, *argv: str) -> str:
    assert cli.main(["inspect", *argv]) == 0
    return capsys.readouterr().out


def test_listing_shows_every_pass_with_its_time(dump, capsys):
    d, rec = dump
    out = _run_cli(capsys, d)
    for s in rec.snapshots:
        assert f"{s.stage:<11}{s.pass_name}" in out
    assert f"graph {rec.id}" in out and "insert_release" in out and "ms" in out
    assert out.strip() == format_list(load(d)).strip()


def test_diff_counts_what_each_pass_added(dump):
    d, rec = dump
    g = load(d).graph(rec.id)
    text = format_diff(g, "forward")
    n_release = rec.final("forward").count("zinf.release")
    assert f"+{n_release} zinf.release.default" in text
    assert "sink_fetch" in text and "moved" in text  # sink_fetch reorders, adds nothing
    assert "+" not in text.split("sink_fetch")[1].split("insert_release")[0].split("moved")[0]


def test_graph_before_and_after_a_pass(dump, capsys):
    d, rec = dump
    out = _run_cli(capsys, d, "--graph", str(rec.id), "--stage", "forward", "--pass", "insert_release")
    before, after = out.split("after pass 'insert_release'")
    assert "zinf.release" not in before and "zinf.release" in after
    udiff = format_graph(load(d).graph(rec.id), "forward", "insert_release", show="udiff")
    assert any(line.startswith("+") and "zinf.release" in line for line in udiff.splitlines())
    with pytest.raises(ValueError, match="--stage forward --pass sink_fetch; --stage backward"):
        format_graph(load(d).graph(rec.id), None, "sink_fetch")


def test_node_explains_pass_and_reason(dump, capsys):
    d, rec = dump
    fwd = rec.final_modules["forward"]
    rel = next(n for n in fwd.graph.nodes if n.meta.get("zinf", {}).get("kind") == "release"
               and "fc.weight" in n.meta["zinf"]["param"])
    out = _run_cli(capsys, d, "--node", rel.name, "--stage", "forward")
    z = rel.meta["zinf"]
    assert "inserted by  pass insert_release (forward)" in out
    assert f"release of blocks.0.fc.weight (uid {z['uid']}) after its last reader {z['after']}" in out
    # a fetch in the backward: inserted in the joint graph, carried over by the partitioner (as the
    # graph stood before the schedule pass split it into a start and a wait)
    pre = next(sn for sn in rec.graphs("backward") if sn.pass_name == "insert_release")
    fetch = next(z["node"] for z in pre.zinf_nodes if z["kind"] == "fetch_shard")
    text = explain_node(load(d), fetch, stage="backward")
    assert "pass insert_fetch (joint)" in text and "partitioner carried it into the backward" in text
    assert "own 1/dp shard" in text
    red = next(z["node"] for z in pre.zinf_nodes if z["kind"] == "reduce_grad")
    assert "inserted by  pass reduce_grad (backward)" in explain_node(load(d), red, stage="backward")
    # and its scheduled form: the wait that replaced it, inserted by the schedule pass
    wait = next(n for n in rec.final_modules["backward"].graph.nodes
                if n.meta.get("zinf", {}).get("kind") == "fetch_shard")
    assert wait.target is torch.ops.zinf.wait_upload.default
    assert "inserted by  pass schedule (backward)" in explain_node(load(d), wait.name, stage="backward")
    plain = explain_node(load(d), "addmm", stage="forward")
    assert "not a zinf node" in plain and "AOTAutograd's trace" in plain
    with pytest.raises(ValueError, match="did you mean"):
        explain_node(load(d), rel.name + "x")


def test_bad_dump_dir_is_an_error(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path)]) == 2
    assert "no compiled graphs" in capsys.readouterr().err


def test_torch_logs_alias_routes_pass_timings(caplog):
    log = logging.getLogger("zinf_compile")
    saved = [(lg, lg.level, lg.propagate) for lg in (log, logging.getLogger("zinf_runtime"))]
    torch._logging.set_logs(modules={"zinf": logging.DEBUG})  # torch's handlers; they do not propagate
    log.addHandler(caplog.handler)
    try:
        assert log.getEffectiveLevel() == logging.DEBUG
        m = torch.nn.Linear(4, 3)
        torch.compile(m, backend="zinf", options={"compiler": "eager"})(torch.randn(2, 4)).sum().backward()
    finally:
        log.removeHandler(caplog.handler)
        torch._logging.set_logs()
        for lg, level, propagate in saved:  # as plain loggers again, for the tests that follow
            lg.setLevel(level)
            lg.propagate = propagate
    msgs = [r.getMessage() for r in caplog.records if r.name == "zinf_compile"]
    assert any("pass insert_release took" in m for m in msgs), msgs
    # dp = 1 in memory: the fetches stay single ops read in place (nothing moves): the schedule adds
    # no start/wait and insert_release no release (it would free nothing); keep_alive's one keep is all
    assert any("forward: 6 passes in" in m and m.endswith("ops +1 zinf.keep.default") for m in msgs), msgs


def test_torch_logs_env_and_structured_trace(tmp_path):
    script = textwrap.dedent("""
        import torch, zinf_compile
        m = torch.nn.Linear(4, 3)
        torch.compile(m, backend="zinf", options={"compiler": "eager"})(torch.randn(2, 4)).sum().backward()
    """)
    env = dict(os.environ, TORCH_LOGS="+zinf_compile", TORCH_TRACE=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "zinf: forward pass insert_release took" in r.stderr
    logs = "".join(open(p).read() for p in glob.glob(str(tmp_path / "*.log")))
    for name in ("zinf_000_00_dynamo_input", "forward_insert_release", "backward_reduce_grad"):
        assert name in logs, name
    assert "torch.ops.zinf.fetch_shard.default" in logs  # the artifact's payload is the graph's code
