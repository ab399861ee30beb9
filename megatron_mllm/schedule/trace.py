"""Timelines out: Chrome trace JSON (Perfetto opens it) and a PNG, one row per rank and stream.

The runtime's measured traces use the same format (`chrome_trace_events`), so a prediction and
a real run can be opened side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_mllm.schedule.simulator import SimResult, Span

COLORS = {
    "F": "#4c72b0",
    "B": "#55a868",
    "EF": "#dd8452",
    "EB": "#c44e52",
    "EW": "#937860",
    "W": "#8da0cb",
    "tp": "#8c8c8c",
    "dp": "#8172b3",
    "p2p": "#64b5cd",
}


def _track(span: Span) -> str:
    if span.stream == "compute":
        return "compute" if span.slot is None else f"compute slot {span.slot}"
    if span.stream == "comm":
        return "tp comm" if span.slot is None else f"tp comm slot {span.slot}"
    return span.stream


def chrome_trace_events(spans: list[Span], label: str = "") -> list[dict]:
    """Complete ('X') events, one process per rank and one thread per stream."""
    events: list[dict] = []
    tids: dict[tuple[int, str], int] = {}
    for s in spans:
        key = (s.rank, _track(s))
        if key not in tids:
            tids[key] = len([k for k in tids if k[0] == s.rank])
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": s.rank,
                    "tid": tids[key],
                    "args": {"name": key[1]},
                }
            )
        events.append(
            {
                "ph": "X",
                "name": s.name,
                "cat": s.category,
                "pid": s.rank,
                "tid": tids[key],
                "ts": s.start * 1e6,
                "dur": max(s.end - s.start, 0.0) * 1e6,
            }
        )
    for rank in sorted({s.rank for s in spans}):
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "args": {"name": f"{label} rank {rank}".strip()},
            }
        )
    return events


def write_chrome_trace(result: SimResult, path: str | Path, label: str = "") -> None:
    Path(path).write_text(
        json.dumps(
            {"traceEvents": chrome_trace_events(result.spans, label), "displayTimeUnit": "ms"}
        )
    )


def _color(span: Span) -> str:
    if span.category in ("tp", "dp", "p2p"):
        return COLORS[span.category]
    return COLORS.get(span.action.kind, "#999999")


def write_png(results: dict, path: str | Path) -> None:
    """One panel per schedule, rows = ranks (compute streams), same time axis for all.

    `results` values need `.spans`, `.step_time_s` and `.bubble_ratio` (a SimResult, or a
    `MeasuredTimeline` for a real run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(results)
    horizon = max(r.step_time_s for r in results.values())
    fig, axes = plt.subplots(len(names), 1, figsize=(14, 2.2 * len(names) + 0.6), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=False):
        res = results[name]
        rows: dict[tuple[int, str], int] = {}
        for s in res.spans:
            if s.stream not in ("compute", "dp"):
                continue
            key = (s.rank, _track(s))
            rows.setdefault(key, 0)
        order = sorted(rows)
        for i, key in enumerate(order):
            rows[key] = i
        bars: dict[str, list] = {}
        for s in res.spans:
            key = (s.rank, _track(s))
            if key in rows:
                bars.setdefault(_color(s), []).append((rows[key], s.start, s.end - s.start))
        for color, items in bars.items():
            for row in sorted({r for r, _, _ in items}):
                xs = [(a, w) for r, a, w in items if r == row]
                ax.broken_barh(xs, (row - 0.4, 0.8), facecolors=color, linewidth=0)
        ax.set_yticks(range(len(order)))
        ax.set_yticklabels([f"r{r} {t}" for r, t in order], fontsize=6)
        ax.invert_yaxis()
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(
            f"{name}: step {res.step_time_s:.3f} s, bubbles {res.bubble_ratio:.1%}",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel("seconds")
    legend = [Patch(color=c, label=k) for k, c in COLORS.items() if k != "p2p"]
    fig.legend(handles=legend, loc="upper right", ncol=len(legend), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


class MeasuredTimeline:
    """What a real run recorded, shaped for `write_png`."""

    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans
        self.step_time_s = max((s.end for s in spans), default=0.0)
        ranks = {s.rank for s in spans}
        busy = sum(s.end - s.start for s in spans if s.stream == "compute")
        total = self.step_time_s * max(len(ranks), 1)
        self.bubble_ratio = 1 - busy / total if total else 0.0
