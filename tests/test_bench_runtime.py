"""tools/bench_runtime.py's arithmetic on fixed inputs (the benchmark itself is not a test)."""

from __future__ import annotations

from types import SimpleNamespace

import bench_runtime
import pytest


def test_each_prediction_is_scaled_by_the_reference_runs_drift_over_its_timed_steps():
    phase = SimpleNamespace(steps=10, warmup=4, calibration_steps=2, steps_each=3)
    # the reference run's seconds: calibration steps 2-3; windows 4-6 (candidate 0), 7-9 (1)
    ref = [9.0, 9.0, 1.0, 1.0, 5.0, 1.2, 1.2, 5.0, 2.0, 2.0]
    outs = {
        "executor_megatron": [{"seconds": ref}, {"seconds": [0.5] * 10}],  # the slowest rank's
        "optimus_candidates": [{"candidate_of_step": [0] * 7 + [1] * 3}],
    }
    rows = [{"predicted_s": 1.0, "measured_s": 1.5}, {"predicted_s": 0.5, "measured_s": 1.25}]
    got = bench_runtime.drift_corrected(rows, outs, phase)
    assert [r["drift"] for r in got] == pytest.approx([1.2, 2.0])
    assert got[1]["predicted_s"] == pytest.approx(1.0)
    assert bench_runtime.worst_error(got, "predicted_s") == pytest.approx(0.2)
    assert bench_runtime.worst_error(rows, "predicted_s") == pytest.approx(0.6)
