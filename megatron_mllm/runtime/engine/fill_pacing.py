"""TP-bubble fills paced by the plan, not by host polling.

On a GPU the host runs far ahead of the device, so "run fills until the collective reports
completion" would drain the whole queue into the first collective of an action. Each collective
wait instead gets the number of fills the schedule planned into its bubble.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_mllm.runtime.engine.program import Op
from megatron_mllm.schedule.actions import Action


def fill_budgets(fills: tuple[Action, ...], collectives: int, planned: int) -> list[int]:
    """How many of a backbone action's fills may run inside each of its `collectives` TP
    collectives: a fill the schedule planned into TP bubble n (of `planned` bubbles) belongs to
    collective n * collectives // planned (the planned order, stretched over the collectives
    that really run)."""
    budgets = [0] * collectives
    if collectives:
        for f in fills:
            budgets[min(collectives - 1, (f.fill or 0) * collectives // max(planned, 1))] += 1
    return budgets


class FillPacer:
    """One backbone action's filler (patches/async_tp_collectives.py): inside its i-th TP
    collective it runs at most `budgets[i]` of the queued fills, in order, and stops early once
    the collective is done; what is left runs after the action."""

    def __init__(
        self, fills: tuple[Action, ...], budgets: list[int], run: Callable[[Action, str], None]
    ) -> None:
        self.queue, self.budgets, self.run = list(fills), budgets, run
        self.ran: list[int] = []  # fills run inside each wait; its length counts the waits

    def __call__(self, kind: str, done: Callable[[], bool]) -> int:
        i = len(self.ran)
        budget, ran = (self.budgets[i] if i < len(self.budgets) else 0), 0
        while ran < budget and self.queue and not done():
            self.run(self.queue.pop(0), kind)
            ran += 1
        self.ran.append(ran)
        return ran


def planned_bubbles(program: list[Op]) -> dict[tuple[str, int, int], int]:
    """(kind, stage, chunk) of a backbone action -> how many TP bubbles its fills were planned
    over (one past the highest bubble index any of its fills uses)."""
    out: dict[tuple[str, int, int], int] = {}
    for op in program:
        if op.kind == "run" and op.fills:
            a, top = op.action, max(f.fill or 0 for f in op.fills) + 1
            key = (a.kind, a.stage, a.chunk)
            out[key] = max(out.get(key, 0), top)
    return out
