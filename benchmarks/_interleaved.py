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
threads). What interleaving cannot show (first step, peak RSS) stays in the fresh-process table.
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


def run_pair(pair: Tuple[str, str, str, float, int, str, str], size: str, rounds: int, global_batch: int,
             threads: int, adam: str, timeout: float, env: Dict[str, str], log_path: str,
             free_port: Callable[[], int]) -> Dict[str, Any]:
    """Run ``ab_overhead.py`` for one pair; its JSON plus when and how it ran, or ``ok: False`` and why."""
    text, zrow, prow, goal, dp, peer, zinf = pair
    with tempfile.TemporaryDirectory(prefix="zinf-interleave-") as tmp:
        out = os.path.join(tmp, "ab.json")
        run_env = dict(env, SIZE=size, ROUNDS=str(rounds), BATCH=str(global_batch), THREADS=str(threads),
                       ADAM=adam, JSON=out)
        cmd = [sys.executable, AB, peer, zinf] if dp == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), AB, peer, zinf]
        t0 = time.time()
        # its own session, as compare.py's rows: a timeout or an interrupt kills torchrun's ranks too
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             env=run_env, cwd=os.path.dirname(HERE))
        rc: Optional[int]
        try:
            log, _ = p.communicate(timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            log, rc = p.communicate()[0] or "", None
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
        shown = (["python", "benchmarks/ab_overhead.py"] if dp == 1 else
                 ["torchrun", "--nproc-per-node", str(dp), "benchmarks/ab_overhead.py"]) + [peer, f"'{zinf}'" if "{" in zinf else zinf]
        with open(log_path, "w") as f:
            f.write(" ".join(cmd) + "\n\n" + log)
        base = {"goal": text, "zinf_row": zrow, "peer_row": prow, "goal_ratio": goal, "dp": dp,
                "command": f"SIZE={size} ROUNDS={rounds} BATCH={global_batch} THREADS={threads} ADAM={adam} " + " ".join(shown),
                "run_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)), "wall_s": round(time.time() - t0, 1)}
        if rc != 0 or not os.path.exists(out):
            lines = [ln for ln in log.splitlines() if "Error" in ln and ":" in ln]
            why = "timed out" if rc is None else (lines[-1].strip() if lines else f"exit status {rc}")
            return dict(base, ok=False, why=why[:300])
        with open(out) as f:
            return dict(base, ok=True, **json.load(f))


def goal_line(res: Dict[str, Any], fresh: Optional[float]) -> str:
    """One goal's interleaved verdict: the median of the rounds' ratios, their quartiles, and how many
    rounds met the goal; ``fresh``: the same goal's ratio from the fresh-process table, if any."""
    text, goal = res["goal"], res["goal_ratio"]
    where = f"{text}, interleaved in one process"
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
    return (f"{'PASS' if ratio <= goal else 'MISS'} {where}: {ratio:.2f}x (median of {res['rounds']} rounds' "
            f"ratios, IQR {lo:.2f}-{hi:.2f}; {met} of {res['rounds']} rounds within {goal}x){fresh_text}{spill_text}")
