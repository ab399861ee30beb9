"""tools/bench_runtime.py's arithmetic, and its varying-load benchmark's, on fixed inputs (the
benchmarks themselves are not tests)."""

from __future__ import annotations

import bench_runtime
import pytest

from megatron_mllm.training.plan_candidates import CandidatePhase, windows


def test_each_prediction_is_scaled_by_the_reference_runs_drift_over_its_timed_steps():
    phase = CandidatePhase(candidates=(None, None), steps_each=3, warmup=4)
    # the reference run's seconds: calibration steps 2-3; windows 4-5 (candidate 0), 6-8 (1),
    # 9-10 (0 again); each window's first step is not timed; then the 7 steps a second look
    # would have taken (here the kept plan's)
    ref = [9.0, 9.0, 1.0, 1.0, 5.0, 1.0, 5.0, 2.0, 2.0, 5.0, 1.4] + [1.0] * 7
    assert len(ref) == phase.steps
    outs = {
        "executor_megatron": [{"seconds": ref}, {"seconds": [0.5] * 18}],  # the slowest rank's
        "optimus_candidates": [{"seconds": [1.0] * 18, "candidate_of_step": [0] * 18}],
    }
    steps = bench_runtime.phase_steps(outs, phase)
    rows = [{"predicted_s": 1.0, "measured_s": 1.5}, {"predicted_s": 0.5, "measured_s": 1.25}]
    got = bench_runtime.drift_corrected(rows, steps, windows([0, 1], 3), phase)
    assert [r["drift"] for r in got] == pytest.approx([1.2, 2.0])
    assert got[1]["predicted_s"] == pytest.approx(1.0)
    assert bench_runtime.worst_error(got, "predicted_s") == pytest.approx(0.2)
    assert bench_runtime.worst_error(rows, "predicted_s") == pytest.approx(0.6)


def test_the_floor_is_how_far_a_plans_first_window_misses_its_measurement():
    """Three candidates run 1, 0, 2 after 2 warm-up steps, windows of 2 timed steps: 1 and 0 are
    timed twice (mirrored), 2 once (the middle); the floor is the worst first-window miss."""
    phase = CandidatePhase(candidates=(None, None, None), steps_each=5, warmup=2)
    #          warm-up | 1: w, 1.0, 1.2  | 0: w, 2.0, 2.0 | 2: w, 4 timed | 0: w, 2.5, 2.5 | 1: ...
    seconds = [9, 9, 9, 1.0, 1.2, 9, 2.0, 2.0, 9, 3, 3, 3, 3, 9, 2.5, 2.5, 9, 1.1, 1.1]
    steps = {"optimus_candidates": seconds}
    rows = [{"measured_s": 2.25}, {"measured_s": 1.1}, {"measured_s": 3.0}]
    floor = bench_runtime.window_floor(rows, steps, windows([1, 0, 2], 5), phase)
    assert floor == pytest.approx(max(0.25 / 2.25, 0.0))


def test_the_balancing_bound_is_each_steps_time_over_its_even_compute():
    """tools/bench_varying_load.py: a run's step over its zero-bubble limit, per step, median."""
    import bench_varying_load

    repeat = {"times": {"optimus": [2.0, 3.0, 1.0]}, "limit": {"optimus": [1.0, 2.0, 1.0]}}
    assert bench_varying_load._over_limit(repeat, "optimus") == pytest.approx(1.5)


def test_the_real_job_benchmark_reads_the_table_the_job_prints():
    """tools/bench_plan_candidates.py parses the candidate table pretrain_mllm.py prints (labels
    longer than its column included) and summarises the worst error and the kept plan's speed
    against the Megatron candidate over repeats."""
    import argparse

    import bench_plan_candidates as bpc

    from megatron_mllm.training.candidate_run import table

    def row(label, pred, meas, kept=False):
        return {"label": label, "predicted_startup_s": 5.0, "predicted_s": pred,
                "measured_s": meas, "kept": kept, "same_as": None}  # fmt: skip

    long = "optimus DP2 TP1 PP1 even fine +1 split bb-split"  # 47 characters
    repeats = [
        [row(long, 1.10, 1.00), row("optimus x", 0.95, 1.00, True), row("megatron", 1.2, 1.5)],
        [row(long, 1.00, 1.00, True), row("megatron", 1.1, 1.0)],
    ]
    text = [table(rows, 1.0, 2, 0) + "\n   the phase's own cost: ..." for rows in repeats]
    parsed = [bpc.parse_table(t) for t in text]
    assert [[r["label"] for r in rows] for rows in parsed] == [
        [long, "optimus x", "megatron"],
        [long, "megatron"],
    ]
    assert parsed[0][1]["kept"] and parsed[0][2]["measured_s"] == pytest.approx(1.5)
    args = argparse.Namespace(size="tiny", microbatches=8, micro_batch=1, plan_candidates=2,
                              train_iters=None, ddp_bucket_size=0, precision="bf16",
                              encoder_wgrad_split=False, backbone_wgrad_split=False)  # fmt: skip
    out = bpc.summarise(parsed, args, 3)
    assert out["candidate_prediction_error"] == pytest.approx((0.2 + 0.1) / 2)
    assert (out["candidate_prediction_error_min"], out["candidate_prediction_error_max"]) == (
        pytest.approx(0.1),
        pytest.approx(0.2),
    )
    assert out["kept_vs_megatron_candidate"] == pytest.approx((1.5 + 1.0) / 2)
    # relative to the first candidate's 1.1: 0.95 / 1.1 - 1 and 0.8 / 1.1 - 1; then 1.1 / 1 - 1
    assert out["megatron_relative_error"] == pytest.approx([0.8 / 1.1 - 1, 0.1])
    assert out["candidate_relative_error"] == pytest.approx((1 - 0.8 / 1.1 + 0.1) / 2)
    # a candidate with no prediction (its costs not rebuilt) is read, and left out of the worst
    nan_rows = bpc.parse_table(table([row(long, float("nan"), 1.0), row("megatron", 1.1, 1.0)],
                                     1.0, 2, 0))  # fmt: skip
    assert len(nan_rows) == 2 and nan_rows[0]["predicted_s"] != nan_rows[0]["predicted_s"]
    assert bpc._worst(bpc.error(r) for r in nan_rows) == pytest.approx(0.1)
