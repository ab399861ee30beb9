"""tools/profile_kernels.py on this CPU at small shapes: per-kernel times of a TP shard's
layer, written as measured-times JSON that plan_schedule.py reads; bad input in one line."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.schedule.cost_model import BACKWARD_KERNELS, FORWARD_KERNELS
from tests.conftest import ROOT


def _shard_shapes(rank: int, world: int) -> dict:
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import solo_groups
    from megatron_mllm.runtime.planning.profile_kernels import shard_layer
    from megatron_mllm.schedule.specs import BUILTIN_MODELS

    init_rank(rank, world, 0, 60.0)
    layer = shard_layer(BUILTIN_MODELS["vit-22b"], 8, torch.float32, "cpu", solo_groups())
    return {n: tuple(p.shape) for n, p in layer.named_parameters()}


def test_a_tp_shard_layer_has_one_gpus_shapes():
    """ViT-22B at TP=8: QKV 3h/8 x h, projection h x h/8, MLP h -> f/8 -> h."""
    shapes = spawn(_shard_shapes, 1)[0]
    h, f = 6144, 24576
    assert shapes["self_attention.linear_qkv.weight"] == (3 * h // 8, h)
    assert shapes["self_attention.linear_proj.weight"] == (h, h // 8)
    assert shapes["mlp.linear_fc1.weight"] == (f // 8, h)
    assert shapes["mlp.linear_fc2.weight"] == (h, f // 8)


@pytest.mark.slow  # 11 s (two subprocesses)
def test_profile_kernels_writes_times_plan_schedule_reads(tmp_path):
    out = tmp_path / "times.json"
    cmd = [sys.executable, str(ROOT / "tools" / "profile_kernels.py"), "--model", "vit-22b"]
    cmd += ["--model", "gpt-11b", "--tp", "8", "--seq-len", "32", "--encoder-seq-len", "16"]
    cmd += ["--dtype", "fp32", "--repeats", "1", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    times = json.loads(out.read_text())
    for model in ("vit-22b", "gpt-11b"):
        assert set(times[model]["forward"]) == set(FORWARD_KERNELS)
        assert set(times[model]["backward"]) == set(BACKWARD_KERNELS)
        forward, backward = times[model]["forward"], times[model]["backward"]
        assert all(v > 0 for v in forward.values()), forward  # each kernel really ran
        # a backward is timed as (forward + backward) - forward, clamped: one may read 0
        assert all(v >= 0 for v in backward.values()) and sum(backward.values()) > 0, backward
    plan = [sys.executable, str(ROOT / "tools" / "plan_schedule.py"), "--encoder", "vit-22b"]
    plan += ["--backbone", "gpt-11b", "--gpus", "512", "--tp", "8", "--pp", "4"]
    plan += ["--global-batch", "256", "--micro-batch", "1", "--seq-len", "2048"]
    plan += ["--measured-times", str(out)]
    planned = subprocess.run(plan, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert planned.returncode == 0 and "optimus" in planned.stdout, planned.stderr[-2000:]
    bad = subprocess.run([*cmd[:-2], "--out", str(out), "--tp", "7"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip() == "error: vit-22b does not split over TP 7"
