"""Draw a zinf step trace (``options={"trace": path}``) as one row of bars per lane, to a PNG.

Why: the Chrome/Perfetto viewers need a browser; a picture in the README shows at a glance
whether transfers run under compute (bars stacked in time across lanes) or after it.

    python benchmarks/plot_trace.py benchmarks/results/overlap-after-scheduler-eager.trace.json docs/trace.png
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, List, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"compute": "#4c72b0", "wait": "#c44e52", "nvme_read": "#dd8452", "nvme_write": "#937860",
          "h2d": "#55a868", "d2h": "#8172b3", "all_gather": "#64b5cd", "reduce_scatter": "#da8bc3",
          "optimizer": "#8c8c8c"}


def lanes_of(events: List[dict]) -> Tuple[List[str], Dict[str, List[Tuple[float, float]]]]:
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans: Dict[str, List[Tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X":
            lane = names.get(e["tid"], e.get("cat", "?"))
            spans.setdefault(lane, []).append((e["ts"] / 1e6, e["dur"] / 1e6))
    order = [names[t] for t in sorted(names)]
    return order, spans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("png")
    p.add_argument("--title", default=None)
    args = p.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    order, spans = lanes_of(events)
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(order) + 1.2))
    for i, lane in enumerate(order):
        bars = spans.get(lane, [])
        if bars:
            ax.broken_barh(bars, (len(order) - 1 - i - 0.4, 0.8), facecolors=COLORS.get(lane, "#333333"))
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels(list(reversed(order)))
    ax.set_xlabel("seconds from the step's first event")
    ax.set_title(args.title or f"zinf step trace: {args.trace}")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    total = max((s + d for v in spans.values() for s, d in v), default=0.0)
    busy = {lane: sum(d for _, d in v) for lane, v in spans.items()}
    print(f"wrote {args.png}: step {total:.2f} s; busy seconds per lane: "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(busy.items())))


if __name__ == "__main__":
    main()
