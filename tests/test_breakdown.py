"""Where a step's time goes (runtime/engine/breakdown.py): interval arithmetic and the
breakdown of a step's spans, on spans whose answer is known."""

from __future__ import annotations

import pytest

from megatron_mllm.runtime.engine.breakdown import breakdown_of_spans, measure, minus, union
from megatron_mllm.schedule.actions import Action
from megatron_mllm.schedule.simulator import Span


def test_union_measure_and_minus():
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert measure([(0, 1), (0.5, 2), (3, 4)]) == 3
    assert minus([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert minus([(0, 1)], [(1, 2)]) == [(0, 1)]
    assert minus([(0, 1)], [(-1, 2)]) == []


FORWARD = Action("F")


def _span(stream, category, start, end, action=FORWARD):
    return Span(0, None, stream, action, "", start, end, category)


def test_a_step_breaks_down_into_compute_waits_comm_fills_and_overhead():
    """A backbone forward 0-4 s with a TP wait 1-3 s of which a fill (encoder) covers 1-2 s;
    a receive 4.5-5.5 s; a DP wait 6-7 s; a step of 8 s. Unhidden TP: 2-3 s."""
    recv = Action("RECV", key="act.s1v0.m0")
    spans = [
        _span("compute", "backbone", 0.0, 4.0),
        _span("comm", "tp", 1.0, 3.0),
        _span("compute", "encoder", 1.0, 2.0, Action("EF", k1=1)),
        _span("p2p", "p2p", 4.5, 5.5, recv),
        _span("dp", "dp", 6.0, 7.0, Action("RS", key="bb")),
    ]
    b = breakdown_of_spans(spans, 8.0)
    assert b.compute_s == pytest.approx(3.0)  # 4 s of compute spans less 1 s of unhidden TP
    assert b.comm_unhidden_s == pytest.approx(2.0)  # the DP wait and the unfilled TP second
    assert b.fill_s == pytest.approx(1.0)
    assert b.wait_s == pytest.approx(1.0)
    assert b.wait_by_message == {"RECV:act.s1v0.m0": pytest.approx(1.0)}
    assert b.overhead_s == pytest.approx(2.0)  # 4-4.5, 5.5-6, 7-8
    assert b.compute_s + b.wait_s + b.comm_unhidden_s + b.overhead_s == pytest.approx(8.0)
    assert b.actions == 3  # two compute actions and one message
    assert b.overhead_per_action_s == pytest.approx(2.0 / 3)


def test_the_timing_log_block_reads_as_megatrons_timers():
    """--timing-log-level's block: Megatron's header per option, one row per timer, the ranks'
    min and max (or each rank), and level 2's longest waits per rank."""
    from megatron_mllm.training.timing_log import TIMERS, timing_lines

    ranks = [dict.fromkeys(TIMERS, 0.010), dict.fromkeys(TIMERS, 0.030)]
    ranks[1]["waits"] = [("RECV:act.s1v0.m0", 0.002)]
    minmax = timing_lines(ranks, "minmax").splitlines()
    assert minmax[0] == "(min, max) time across ranks (ms):"
    assert len(minmax) == 1 + len(TIMERS) + 1
    assert minmax[1].startswith("    step ....") and minmax[1].endswith(": (10.00, 30.00)")
    assert minmax[-1] == "    rank  1 longest message waits (ms per step): RECV:act.s1v0.m0 2.00"
    assert timing_lines(ranks, "max").splitlines()[1].endswith(": 30.00")
    every = timing_lines(ranks, "all").splitlines()
    assert every[:4] == [
        "times across ranks (ms):",
        "    step:",
        "     rank  0: 10.00",
        "     rank  1: 30.00",
    ]
