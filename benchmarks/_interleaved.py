"""``compare.py``'s interleaved goals: two systems in one process, their steps alternating.

Why: on this shared VM a process's speed moves with the machine for minutes at a time. Runs of one
row minutes apart differed by up to 13% (2026-12-07: zinf without offload at 0.533 and 0.59 s a
step, Inductor at 0.531 and 0.604 s, the same code within 30 minutes), while the steps inside one
process stayed within 2% of their median. A goal whose margin is 5 or 10% cannot be read from fresh processes run
one after the other, short of many rounds. Two systems built in one process and stepped in turn
(A B, then B A, ...) see the same machine at the same time, so each round's ratio cancels the
drift; the median of the rounds' ratios, with its quartiles, is what this module reports.

    fresh processes (compare.py's table)        interleaved (here, ``benchmarks/ab_overhead.py``)
    [inductor] ... minutes ... [zinf]           one process: inductor, zinf, zinf, inductor, ...
    ratio = median(zinf) / median(inductor)     ratio = median over rounds of zinf_r / inductor_r

Only pairs that can share a process without changing either side are interleaved: Inductor and
zinf without offload at dp 1 (zinf starts no thread there), FSDP2 ``CPUOffloadPolicy`` and zinf's
CPU offload at dp 2 (zinf's copy and IO threads sleep on their queues while FSDP2 steps). DeepSpeed
is not: its engine owns process-wide state (its accelerator, its own process-group setup, aio
threads). What interleaving cannot show (first step, peak RSS) stays in the fresh-process table. Each system
also runs alone in a process of its own, beside the pair, so a line shows whether sharing a process
changed either side (it did on 2026-12-05, to FSDP2; it did not on 2026-12-07).
Every step here reuses one batch; the table's rows step a new batch each time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
AB = os.path.join(HERE, "ab_overhead.py")

# (goal text, zinf row, peer row, goal ratio, dp, ab_overhead's peer variant, its zinf variant)
PAIRS: List[Tuple[str, str, str, float, int, str, str]] = [
    ("zinf no offload <= 1.05x Inductor", "zinf-none-dp1", "inductor", 1.05, 1, "inductor", "zinf"),
    ("zinf CPU offload (dp 2) <= 0.9x FSDP2 CPUOffloadPolicy", "zinf-cpu-dp2", "fsdp2-cpu", 0.9, 2, "fsdp2-cpu",
     'zinf-cpu={"offload_params":"cpu","offload_optimizer":"cpu"}'),
]


def run_in_session(cmd: List[str], env: Dict[str, str], timeout: float,
                   cwd: Optional[str] = None) -> Tuple[str, Optional[int]]:
    """Run ``cmd`` in a session of its own: (its stdout and stderr, its exit status or None if it
    timed out). Why a session: a timeout or an interrupt kills torchrun's ranks too, not only the
    launcher (compare.py's rows run the same way)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env=env, cwd=cwd)
    try:
        log, _ = p.communicate(timeout=timeout)
        return log, p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        return p.communicate()[0] or "", None
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise


def _ab_run(variants: List[str], dp: int, env: Dict[str, str], timeout: float, log_path: str,
            free_port: Callable[[], int]) -> Tuple[Optional[Dict[str, Any]], str, List[str]]:
    """One ``ab_overhead.py`` process over ``variants``: (its JSON or None, why not, the command as shown)."""
    with tempfile.TemporaryDirectory(prefix="zinf-interleave-") as tmp:
        out = os.path.join(tmp, "ab.json")
        cmd = [sys.executable, AB, *variants] if dp == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), AB, *variants]
        log, rc = run_in_session(cmd, dict(env, JSON=out), timeout, cwd=os.path.dirname(HERE))
        shown = (["python", "benchmarks/ab_overhead.py"] if dp == 1 else
                 ["torchrun", "--nproc-per-node", str(dp), "benchmarks/ab_overhead.py"]) + [
                     f"'{v}'" if "{" in v else v for v in variants]
        with open(log_path, "a") as f:
            f.write(" ".join(cmd) + "\n\n" + log + "\n")
        if rc != 0 or not os.path.exists(out):
            lines = [ln for ln in log.splitlines() if "Error" in ln and ":" in ln]
            return None, "timed out" if rc is None else (lines[-1].strip() if lines else f"exit status {rc}")[:300], shown
        with open(out) as f:
            return json.load(f), "", shown


def run_pair(pair: Tuple[str, str, str, float, int, str, str], size: str, rounds: int, global_batch: int,
             threads: int, adam: str, timeout: float, env: Dict[str, str], log_path: str,
             free_port: Callable[[], int]) -> Dict[str, Any]:
    """Run ``ab_overhead.py`` for one pair: its JSON plus when and how it ran, or ``ok: False`` and why.

    Each system also runs alone in a process of its own, the peer just before the pair and zinf just
    after (``alone``: their median steps). Why: on 2026-12-05 FSDP2 stepped 1.02 s beside zinf in one
    process and 0.79 s alone (README, "two traps"), which made zinf look faster than it was. A
    system markedly slower together than alone shows that the shared process, not zinf, made the ratio.
    """
    text, zrow, prow, goal, dp, peer, zinf = pair
    run_env = dict(env, SIZE=size, ROUNDS=str(rounds), BATCH=str(global_batch), THREADS=str(threads), ADAM=adam)
    open(log_path, "w").close()
    t0 = time.time()
    alone_peer, _, _ = _ab_run([peer], dp, run_env, timeout, log_path, free_port)
    res, why, shown = _ab_run([peer, zinf], dp, run_env, timeout, log_path, free_port)
    alone_zinf, _, _ = _ab_run([zinf], dp, run_env, timeout, log_path, free_port)
    base = {"goal": text, "zinf_row": zrow, "peer_row": prow, "goal_ratio": goal, "dp": dp,
            "command": f"SIZE={size} ROUNDS={rounds} BATCH={global_batch} THREADS={threads} ADAM={adam} " + " ".join(shown),
            "run_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)), "wall_s": round(time.time() - t0, 1),
            # each system's median step in a process of its own (None: that run failed; see the log)
            "alone": {name: (next(iter(r["variants"].values()))["median_step_s"] if r else None)
                      for name, r in ((peer.split("=")[0], alone_peer), (zinf.split("=")[0], alone_zinf))}}
    if res is None:
        return dict(base, ok=False, why=why)
    return dict(base, ok=True, **res)


def goal_line(res: Dict[str, Any], fresh: Optional[float]) -> str:
    """One goal's interleaved verdict: the median of the rounds' ratios, their quartiles, and how many
    rounds met the goal; ``fresh``: the same goal's ratio from the fresh-process table, if any."""
    text, goal = res["goal"], res["goal_ratio"]
    where = f"{text}, interleaved in one process" + (f" ({res['run_at'][11:16]} UTC)" if res.get("run_at") else "")
    if not res.get("ok"):
        return f"n/a  {where}: {res.get('why', '?')}"
    z = next(v for k, v in res["variants"].items() if k != res["baseline"])
    ratio, (lo, hi) = z["paired_median"], z["paired_iqr"]
    met = sum(r <= goal for r in z["paired"])
    fresh_text = f"; fresh processes (above): {fresh:.2f}x" if fresh else ""
    # zinf's threads working inside the peer's steps (work left over from zinf's step) would slow the
    # peer and flatter the ratio: said whenever there was any
    spill = res["variants"][res["baseline"]].get("zinf_threads_cpu_per_step_s", 0.0)
    spill_text = f"; zinf's threads used {spill:.3f} CPU s a step inside the peer's steps" if spill > 0 else ""
    alone = res.get("alone") or {}
    alone_text = "; step together / alone in a process: " + ", ".join(
        f"{n} {v['median_step_s']:.3f} / {alone[n]:.3f} s" for n, v in res["variants"].items()
        if alone.get(n)) if any(alone.get(n) for n in res["variants"]) else ""
    verdict = "PASS" if ratio <= goal else "MISS"
    slowed = shared_process_penalty(res)
    if slowed is not None and slowed > SHARED_PENALTY_LIMIT:
        # the peer lost more to the shared process than zinf did: the ratio would credit zinf with it
        verdict, alone_text = "n/a ", alone_text + (
            f"; no verdict: beside zinf the peer stepped {100 * (slowed - 1):.0f}% slower, relative to "
            f"zinf's own change, than alone (over {100 * (SHARED_PENALTY_LIMIT - 1):.0f}%)")
    return (f"{verdict} {where}: {ratio:.2f}x (median of {res['rounds']} rounds' "
            f"ratios, IQR {lo:.2f}-{hi:.2f}; {met} of {res['rounds']} rounds within {goal}x){fresh_text}{spill_text}"
            f"{alone_text}")


#: how much more the peer may slow down beside zinf than zinf does (together / alone, relative) before
#: the interleaved verdict is withheld. Runs of one system minutes apart moved by up to 13% here, so a
#: tighter limit would withhold verdicts for drift alone.
SHARED_PENALTY_LIMIT = 1.05


def shared_process_penalty(res: Dict[str, Any]) -> Optional[float]:
    """(peer's step together / alone) / (zinf's step together / alone), or None without both alone runs.

    Above 1, sharing the process cost the peer more than zinf, which the interleaved ratio would credit
    to zinf. Measured: at 124M, FSDP2 ``CPUOffloadPolicy`` stepped 5.720 s beside zinf and 4.979 s
    alone, while zinf's CPU offload stepped 3.583 and 3.709 s (2026-12-07): 1.19."""
    alone = res.get("alone") or {}
    peer = res["baseline"]
    zname = next((k for k in res["variants"] if k != peer), None)
    if zname is None or not alone.get(peer) or not alone.get(zname):
        return None
    together = res["variants"]
    return (together[peer]["median_step_s"] / alone[peer]) / (together[zname]["median_step_s"] / alone[zname])
