"""The replay of a measured step (runtime/engine/replay.py): receives wait for their sends,
and each cause removed on its own."""

import pytest

from megatron_mllm.runtime.engine.replay import decomposition, kind_of, replay, top_level
from megatron_mllm.schedule.actions import Action
from megatron_mllm.schedule.simulator import Span

MS = 1e-3
# PP 2, one micro-batch: rank 0 forwards and sends, rank 1 forwards, backwards and sends back.
RANK0 = [("F:s0v0m0", 0.0, 10 * MS), ("SEND:act.s1v0.m0", 10 * MS, 11 * MS),
         ("RECV:grad.s0v0.m0", 11 * MS, 40 * MS), ("B:s0v0m0", 40 * MS, 60 * MS)]  # fmt: skip
RANK1 = [("RECV:act.s1v0.m0", 0.0, 12 * MS), ("F:s1v0m0", 12 * MS, 22 * MS),
         ("B:s1v0m0", 22 * MS, 42 * MS), ("SEND:grad.s0v0.m0", 42 * MS, 43 * MS)]  # fmt: skip


def test_a_receive_waits_for_its_send_and_its_latency():
    lat = 0.5 * MS
    # rank 1's forward starts when rank 0's send ends (11 ms) plus the latency; rank 0's
    # backward when rank 1's send ends (11.5 + 30 + 1) plus the latency
    assert replay([RANK0, RANK1], [0.0, 0.0], lat) == pytest.approx(43 * MS + 20 * MS)
    assert replay([RANK0, RANK1], [0.0, 5 * MS], lat) == pytest.approx(63 * MS)  # absorbed
    late = replay([RANK0, RANK1], [0.0, 20 * MS], lat)
    assert late == pytest.approx(63 * MS + 20 * MS - 11.5 * MS)  # rank 1 starts after it arrived
    with pytest.raises(ValueError, match="none of them sends"):
        replay([RANK0[2:], RANK1], [0.0, 0.0])


def test_the_decomposition_removes_one_cause_at_a_time():
    """Two steps: rank 1 starts 2 ms late (its forward 10 ms), then on time with a 14 ms
    forward. Replayed: 62.5 and 66.5 ms; without sends' host time (1 ms each) 60.5 and 64.5;
    with the forward's median (12 ms) 62.5 both; the busiest rank's compute 30 and 34."""
    slow = [(n, b + 4 * MS * (b >= 22 * MS), e + 4 * MS * (e >= 22 * MS)) for n, b, e in RANK1]
    steps = [[(100.0, RANK0), (100.0 + 2 * MS, RANK1)], [(200.0, RANK0), (200.0, slow)]]
    d = decomposition(steps, step_microbatches=1)
    assert {k: round(v / MS, 6) for k, v in d.items()} == {
        "measured_s": 60.0,  # as traced (these toy traces are not each other's timeline)
        "replay_s": 64.5,
        "no_skew_s": 64.5,  # the 2 ms late start waited for rank 0's send anyway
        "no_message_host_s": 62.5,
        "median_durations_s": 62.5,
        "compute_s": 32.0,
    }


def test_top_level_drops_nested_spans_and_kinds_keep_look_ahead_apart():
    outer = Span(0, None, "compute", Action("B", stage=0, mb=1), "", 0.0, 5.0, "backbone")
    inner = Span(0, None, "comm", Action("B", stage=0, mb=1), "", 1.0, 2.0, "tp")
    after = Span(0, None, "p2p", Action("SEND", key="grad.s0v0.m1"), "", 5.0, 5.5, "p2p")
    assert [n for n, _, _ in top_level([inner, after, outer])] == ["B:s0v0m1", "SEND:grad.s0v0.m1"]
    assert kind_of("F:s1v0m9", 8) == "F:s1v0 (look-ahead)" and kind_of("F:s1v0m3", 8) == "F:s1v0"
