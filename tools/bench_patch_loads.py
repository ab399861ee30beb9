#!/usr/bin/env python
"""How well the planner's native-tower load (schedule/patch_loads.py) predicts what the tower
measures: the Qwen2-VL tower's forward + backward on micro-batches of different images, timed
against the nominal micro-batch (one image of the nominal size), and the load's prediction of
that ratio made before the run; beside it the two-term fit (FIT) and the profile a job makes
(PROFILE: five sizes 1.5x apart), each checked on the cases it was not made from.

    python tools/bench_patch_loads.py [--hidden 256] [--layers 4] [--nominal 16] [--repeats 5]
        [--json]

One CPU rank, fp32, one torch thread. The micro-batches run interleaved, --repeats times each
(after one warm-up round); times are medians (min-max shown) and the ratios are of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {  # name -> each sample's images' patch grids
    "nominal": [[(16, 16)]],
    "small": [[(8, 8)]],
    "12x12": [[(12, 12)]],
    "24x24": [[(24, 24)]],
    "large": [[(32, 32)]],
    "wide": [[(16, 48)]],
    "two images": [[(16, 16), (16, 16)]],
    "two samples": [[(16, 16)], [(8, 16)]],
}


FIT = ("small", "wide")  # the cases the calibrated load is fitted on
# the cases the profiled load is measured on, as a job profiles its tower (`profile_units`:
# from half the nominal image's side, each 1.5x the last)
PROFILE = ("small", "12x12", "nominal", "24x24", "large")


def _scaled(nominal: int) -> dict:
    """CASES for a nominal side of `nominal` patches (the table is written for 16)."""
    k = nominal / 16
    return {n: [[(int(h * k), int(w * k)) for h, w in s] for s in c] for n, c in CASES.items()}


def measure(rank: int, world: int, hidden: int, layers: int, nominal: int, repeats: int):
    """Seconds of each case's forward + backward, per repeat."""
    import torch

    from megatron_mllm.models.qwen2_vision import Qwen2VisionSpec, Qwen2VisionTower
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import solo_groups

    init_rank(rank, world, 0, 120.0)
    torch.set_num_threads(1)
    spec = Qwen2VisionSpec(layers=layers, hidden=hidden, heads=hidden // 64, out_hidden=hidden,
                           patch_size=4)  # fmt: skip
    tower = Qwen2VisionTower(spec, solo_groups())
    cases = _scaled(nominal)
    inputs = {}
    for name, samples in cases.items():
        grids = torch.tensor([(1, h, w) for s in samples for h, w in s])
        inputs[name] = (torch.randn(int(grids.prod(1).sum()), spec.patch_dim), grids)
    times = {name: [] for name in cases}
    for round_ in range(repeats + 1):
        for name, (patches, grids) in inputs.items():
            start = time.perf_counter()
            tower(patches, grids).sum().backward()
            if round_:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--nominal", type=int, default=16, help="the nominal image's side in patches")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.schedule.patch_loads import TowerShape, microbatch_load
    from megatron_mllm.schedule.patch_loads import calibrated as calibrated_shape
    from megatron_mllm.schedule.patch_loads import profiled as profiled_shape

    shape = TowerShape(a.hidden, 4 * a.hidden, a.layers)
    nominal = (a.nominal, a.nominal)
    cases = _scaled(a.nominal)
    predicted = {n: len(s) * microbatch_load(shape, s, nominal) for n, s in cases.items()}
    times = spawn(measure, 1, a.hidden, a.layers, a.nominal, a.repeats)[0]
    base = statistics.median(times["nominal"])
    # The fixed work per micro-batch and the attention's scale from two cases' measurements
    # (the smallest and the widest image); the other three are checked.
    fit = {cases[n][0][0]: statistics.median(times[n]) / base for n in FIT}
    fitted = calibrated_shape(shape, nominal, fit)
    calibrated = {n: len(s) * microbatch_load(fitted, s, nominal) for n, s in cases.items()}
    seconds = {cases[n][0][0][0] * cases[n][0][0][1]: statistics.median(times[n]) for n in PROFILE}
    shaped = profiled_shape(shape, nominal, seconds)
    profile = {n: len(s) * microbatch_load(shaped, s, nominal) for n, s in cases.items()}
    rows = {}
    for name, samples in cases.items():
        median = statistics.median(times[name])
        measured = median / base
        rows[name] = {
            "grids": samples,
            "median_s": median,
            "min_s": min(times[name]),
            "max_s": max(times[name]),
            "measured_vs_nominal": measured,
            "predicted_vs_nominal": predicted[name],
            "prediction_error": predicted[name] / measured - 1,
            "calibrated_vs_nominal": calibrated[name],
            "calibrated_error": calibrated[name] / measured - 1,
            "profiled_vs_nominal": profile[name],
            "profiled_error": profile[name] / measured - 1,
        }
    fixed_share = fitted.fixed / fitted.nominal_cost(nominal)
    if a.json:
        out = {"repeats": a.repeats, "hidden": a.hidden, "fixed_share": fixed_share,
               "attention_scale": fitted.attention_scale, "profile": shaped.profile,
               "cases": rows}  # fmt: skip
        print(json.dumps(out, indent=1))
        return 0
    print(f"{'case':12} {'grids':28} {'median ms (min-max)':24} {'measured':>9} {'predicted':>9}"
          f" {'calibrated':>11} {'profiled':>9}")  # fmt: skip
    for name, r in rows.items():
        spread = f"{1e3 * r['median_s']:.1f} ({1e3 * r['min_s']:.1f}-{1e3 * r['max_s']:.1f})"
        grids = str(r["grids"])
        print(f"{name:12} {grids:28} {spread:24} {r['measured_vs_nominal']:9.2f} "
              f"{r['predicted_vs_nominal']:9.2f} {r['calibrated_vs_nominal']:11.2f} "
              f"{r['profiled_vs_nominal']:9.2f}")  # fmt: skip
    worst = max(abs(r["prediction_error"]) for r in rows.values())
    checked = {n: r for n, r in rows.items() if n not in ("nominal", *FIT)}
    worst_fit = max(abs(r["calibrated_error"]) for r in checked.values())
    print(f"worst prediction error {worst:.1%} (predictions: schedule/patch_loads.py, made "
          "before the run from the tower's shape alone)")  # fmt: skip
    print(
        f"fitted on {' and '.join(FIT)} (fixed work {fixed_share:.1%} of a nominal micro-batch, "
        f"attention x{fitted.attention_scale:.2f} its multiply-adds): worst error "
        f"{worst_fit:.1%} over {', '.join(checked)}"
    )
    between = {n: r for n, r in rows.items() if n not in PROFILE}
    worst_profile = max(abs(r["profiled_error"]) for r in between.values())
    print(
        f"profiled on {', '.join(PROFILE)} (as a job profiles its tower), interpolated between: "
        f"worst error {worst_profile:.1%} over {', '.join(between)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
