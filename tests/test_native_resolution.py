"""A native-resolution vision tower (Qwen2-VL's) in the runtime: micro-batches whose images
have their own sizes (text-only samples included), their multimodal positions as Hugging
Face's, and PP=2 (Megatron's schedule and Optimus) equal to the one-process reference."""

import random
import sys
from dataclasses import replace

import pytest
import torch

from megatron_mllm.data.synthetic import native_microbatch
from megatron_mllm.models.config import TINY
from megatron_mllm.models.positions import native_mrope_position_ids
from megatron_mllm.runtime.assembly.launch import spawn

# 16-pixel nominal images in 4-pixel patches merged 2 x 2: sides of 8 or 16 pixels, 1 to 4
# backbone tokens an image; a Qwen2-shaped backbone with multimodal positions.
CFG = replace(
    TINY,
    vit_native=True,
    patch_size=4,
    image_size=16,
    llm_mrope_section=(2, 3, 3),
    llm_qkv_bias=True,
    llm_bias=False,
)


def test_synthetic_micro_batches_have_images_of_their_own_sizes():
    seen = set()
    for index in range(6):
        batch = native_microbatch(CFG, index, 4)
        assert batch.images.shape == (int(batch.grids.prod(1).sum()), CFG.patch_dim)
        assert batch.image_mask.sum(1).tolist() == _tokens_per_sample(batch)
        seen |= {tuple(g) for g in batch.grids[:, 1:].tolist()}
    assert len(seen) >= 3  # several sizes, not one


def _tokens_per_sample(batch) -> list[int]:
    per = batch.tokens_per_image().tolist()
    out, k = [], 0
    for row in range(batch.num_samples):
        has = bool(batch.image_mask[row].any())
        out.append(per[k] if has else 0)
        k += has
    return out


@pytest.mark.parametrize("seed", range(3))
def test_native_positions_are_hugging_faces(seed):
    """Images of different grids in one row, and in a packed row sample by sample."""
    from transformers import Qwen2VLForConditionalGeneration

    from tests.test_mrope import _hf_config

    hf = Qwen2VLForConditionalGeneration(_hf_config())
    rng = random.Random(seed)
    types, grids, positions, per_sample = [], [], [], []
    for _ in range(3):  # three samples packed in a row
        sample, sample_grids = [], []
        for _ in range(rng.randint(1, 3)):
            rows, cols = rng.randint(1, 3), rng.randint(1, 3)
            sample += [0] * rng.randint(1, 3) + [1] * (rows * cols)
            sample_grids.append((rows, cols))
        sample += [0] * rng.randint(1, 3)
        types += sample
        grids += sample_grids
        positions += range(len(sample))
        per_sample.append((sample, sample_grids))
    mask = torch.tensor([types], dtype=torch.bool)
    ours = native_mrope_position_ids(mask, torch.tensor([positions]), torch.tensor(grids))[:, 0]
    expected = []
    for sample, sample_grids in per_sample:
        ids = torch.tensor([[100 if t else 1 for t in sample]])
        thw = torch.tensor([[1, 2 * r, 2 * c] for r, c in sample_grids])  # before the merge
        kind = torch.tensor([sample], dtype=torch.int)
        expected.append(hf.model.get_rope_index(ids, kind, thw)[0][:, 0])
    assert torch.equal(ours, torch.cat(expected, dim=1))


@pytest.mark.parametrize(
    "schedule", [pytest.param("megatron", marks=pytest.mark.slow), "optimus"]
)  # make test runs the Optimus program; CI the Megatron one too
def test_pp2_on_images_of_their_own_sizes_matches_the_reference(schedule):
    from tests.test_runtime import check_pp2_matches_the_reference

    check_pp2_matches_the_reference(CFG, schedule)


@pytest.mark.slow  # the executor's programs run in make test above
def test_megatron_cores_own_1f1b_on_images_of_their_own_sizes_matches_the_reference():
    """The baseline users have today, megatron-core's 1F1B with the native tower in stage 0's
    forward step, on micro-batches whose images have their own sizes (text-only included)."""
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob
    from megatron_mllm.runtime.modes.runs import run_rank
    from tests.test_runtime import TRAIN, N, check_against, reference_of

    reference = reference_of(CFG, **TRAIN)
    plan = ParallelPlan(1, 1, 2)
    job = RuntimeJob(ModelParts(CFG, reference[0]), PlanParts(plan), DataParts(1, N),
                     mode="megatron_core", **TRAIN)  # fmt: skip
    outs = spawn(run_rank, 2, job)
    check_against(reference, outs, {"encoder": 1, "projector": 1, "backbone": 1})


def test_per_step_plans_on_images_of_their_own_sizes_keep_the_references_losses():
    """optimus-adaptive on native-resolution micro-batches: each step is planned for its
    micro-batches' loads in nominal images by patches (`inputs.batches.encoder_load`, which
    differ from micro-batch to micro-batch), the heaviest moved to other 1F1B slots; step 0's
    losses and gradients and the later steps' losses stay the reference's."""
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.inputs.batches import batches, encoder_load
    from megatron_mllm.runtime.job import (
        DataParts,
        ExecutorSettings,
        ModelParts,
        PlanParts,
        RuntimeJob,
    )
    from megatron_mllm.runtime.modes.runs import run_rank
    from megatron_mllm.runtime.planning.schedules import runtime_schedule
    from tests.test_runtime import TRAIN, N, check_against, check_later_losses, reference_of

    steps = {**TRAIN, "steps": 3}
    reference = reference_of(CFG, **steps)
    plan = ParallelPlan(1, 1, 2)
    schedule = runtime_schedule(CFG, plan, 1, N, "optimus", encoder_plan=ParallelPlan(2, 1, 1))
    adaptive = ExecutorSettings(adaptive=True)
    job = RuntimeJob(ModelParts(CFG, reference[0]), PlanParts(plan, schedule=schedule),
                     DataParts(1, N), executor=adaptive, **steps)  # fmt: skip
    loads = [encoder_load(batches(job, s)(m), CFG) for s in range(3) for m in range(N)]
    assert len(set(loads)) > 3 and 0.0 in loads  # several sizes and text-only micro-batches
    outs = spawn(run_rank, 2, job)
    check_against(reference, outs, {"encoder": 1, "projector": 1, "backbone": 1})
    check_later_losses(reference, outs)
    stats = outs[0]["step_plans"]
    assert stats.planned == 3 and not stats.failures
    orders = outs[0]["step_orders"]
    assert any(o is not None and o != sorted(o) for o in orders), orders  # slots really moved


def test_the_profile_times_the_whole_tower_from_half_the_nominal_image_to_a_full_micro_batch():
    """`profile_units` on a native tower also times its forward + backward on one image of each
    profiled side (half the nominal's, doubling, up to every row's positions as images): the
    measured times the per-step plans weigh micro-batches by (`inputs.batches.tower_cost`)."""
    from megatron_mllm.runtime.inputs.batches import tower_cost
    from megatron_mllm.runtime.planning.profile_units import profile_units, tower_sides

    sides = tower_sides(CFG, 2)
    side = CFG.image_size // CFG.patch_size
    most = int((2 * CFG.seq_len) ** 0.5) * CFG.vit_merge
    assert sides[0] == side // 2 and side in sides and sides[-1] == most
    m = CFG.vit_merge
    assert all(s % m == 0 for s in sides)
    assert all(b <= -(-int(1.5 * a) // m) * m for a, b in zip(sides, sides[1:], strict=False))
    times = spawn(profile_units, 1, CFG, 2, 1)[0]
    tower = times["vit"]["tower"]
    assert [n for n, _ in tower] == [s * s for s in sides]
    assert all(seconds > 0 for _, seconds in tower)
    assert tower_cost(CFG, times).profile_factor(side * side) == pytest.approx(1.0)


# Qwen2.5-VL's tower: RMSNorm, gated SiLU MLP, windows of 1 x 1 merged tokens (8 px) but in
# layer 1, so that the windows cut every image of more than one backbone token.
CFG25 = replace(CFG, vit_normalization="RMSNorm", vit_swiglu=True, vit_activation="silu",
                vit_window=8, vit_full_layers=(1,), vit_ffn=40)  # fmt: skip


@pytest.mark.parametrize("layout, schedule", [("pp2", "optimus"), ("tp2", "megatron")])
def test_the_windowed_tower_matches_the_reference(layout, schedule):
    """Qwen2.5-VL's tower through the executor at PP 2 (Optimus) and at TP 2 (Megatron's
    schedule: the tower on the backbone's TP 2, its heads and MLP split) equals the
    one-process reference."""
    from megatron_mllm.parallel.plans import ParallelPlan
    from tests.test_runtime import check_pp2_matches_the_reference

    plan = ParallelPlan(1, 2, 1) if layout == "tp2" else ParallelPlan(1, 1, 2)
    check_pp2_matches_the_reference(CFG25, schedule, plan)


def test_kernel_sized_units_of_the_windowed_tower_fill_tp_bubbles_and_match_the_reference():
    """Qwen2.5-VL's tower cut into the schedule core's kernels (eight a layer, the merger in
    two), placed by Optimus into the TP bubbles of a TP 2 backbone: the reference's losses and
    gradients."""
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.planning.schedules import runtime_schedule
    from tests.test_runtime import N, check_pp2_matches_the_reference

    plan = ParallelPlan(1, 2, 1)
    planned = runtime_schedule(CFG25, plan, 1, N, "optimus", unit="kernel")
    assert sum(planned.meta.encoders[0].fwd_kernels) == 1 + 8 * CFG25.vit_layers + 2
    assert any("@tp" in str(a) for rank in planned.ranks for a in rank)
    check_pp2_matches_the_reference(CFG25, "optimus", plan, unit="kernel")


QWEN_ARGS = ["--encoder-arch", "qwen2vl", "--patch-dim", "4", "--img-h", "16", "--mrope-section",
             "2", "3", "3", "--add-qkv-bias", "--disable-bias-linear", "--normalization",
             "RMSNorm", "--swiglu"]  # fmt: skip


@pytest.mark.slow  # two pretrain runs; make test runs the executor on these images above
def test_pretrain_trains_the_native_tower_and_resumes_bit_exactly(tmp_path):
    """pretrain_mllm.py --encoder-arch qwen2vl on synthetic images of their own sizes (PP=2
    Optimus, bf16 + distributed optimizer): resumed at iteration 2 it continues bit-exactly."""
    from tests.pretrain_runs import COMMON, resumed_at_2_is_bit_exact

    args = [*COMMON, *QWEN_ARGS, "--train-iters", "4", "--pipeline-model-parallel-size", "2",
            "--bf16", "--use-distributed-optimizer"]  # fmt: skip
    straight, _, _ = resumed_at_2_is_bit_exact(tmp_path, args)
    assert "encoder plan:" in straight.stdout


@pytest.mark.parametrize(
    "extra, msg",
    [(["--recompute-vision"], "does not run with --recompute-vision"),
     (["--encoder-window-size", "16"], "--encoder-window-size sets Qwen2.5-VL's attention"),
     (["--encoder-arch", "qwen2.5vl", "--encoder-full-attention-layers", "2"],
      "full-attention layers [2] are not among the tower's 2 layers"),
     (["--encoder-arch", "qwen2.5vl", "--encoder-window-size", "12"],
      "window 12 px is not a multiple of patch x merge = 8"),
     (["--spatial-merge-size", "0"], "--spatial-merge-size 0: give 1 or more"),
     (["--img-h", "20"], "not a multiple of patch x merge = 8")],
)  # fmt: skip
def test_native_arguments_are_refused_in_one_line(extra, msg, monkeypatch):
    from tests.pretrain_runs import refused

    refused([*QWEN_ARGS, *extra], msg, monkeypatch)


@pytest.mark.slow  # 11 s (a subprocess)
def test_the_dry_run_names_the_native_tower():
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_mllm.py"), "--dry-run", *QWEN_ARGS],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "native resolution: each image at its own size, up to 16 patches" in out.stdout


def test_conversations_with_native_images_agree_with_the_reference(llava_dataset):
    """The LLaVA digits through the task encoder at their own sizes (16 to 48 pixels, 4 to 36
    backbone tokens an image, up to four a conversation, text-only ones too): PP=2 Optimus
    equals the one-process reference."""
    from megatron_mllm.data.llava_source import LlavaData
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.inputs.batches import StepData
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.modes.runs import run_rank
    from megatron_mllm.runtime.planning.schedules import runtime_schedule
    from tests.test_runtime import TRAIN, check_against

    seq, mb, n = 96, 2, 3
    train = dict(TRAIN, steps=1)
    cfg = replace(CFG, text_len=seq - CFG.image_tokens, vocab_size=384)
    path, tokenizer = llava_dataset
    data = LlavaData(str(path), str(tokenizer), seq, num_workers=1, min_pixels=64, max_pixels=2304)
    state = spawn(make_full_state, 1, cfg, 0)[0]
    one = ParallelPlan(1, 1, 1)
    reference = RuntimeJob(
        ModelParts(cfg, state), PlanParts(one), DataParts(mb, n, llava=data), mode="reference",
        **train,
    )  # fmt: skip
    ref = spawn(run_rank, 1, reference)[0]
    stream = StepData(reference, [0])
    batches = [stream.step(0)(m) for m in range(n)]
    stream.close()
    assert all(b.native for b in batches)
    sizes = {tuple(g) for b in batches for g in b.grids[:, 1:].tolist()}
    assert len(sizes) >= 3  # images of several sizes
    plan = ParallelPlan(1, 1, 2)
    job = RuntimeJob(
        ModelParts(cfg, state),
        PlanParts(plan, schedule=runtime_schedule(cfg, plan, mb, n, "optimus")),
        DataParts(mb, n, llava=data),
        **train,
    )
    outs = spawn(run_rank, 2, job)
    check_against((state, ref), outs, {"encoder": 1, "projector": 1, "backbone": 1})


def _native_conversations(llava_dataset, seq: int):
    from megatron_mllm.data.llava_source import LlavaData

    path, tokenizer = llava_dataset
    data = LlavaData(str(path), str(tokenizer), seq, num_workers=1, min_pixels=64, max_pixels=2304)
    return replace(CFG, text_len=seq - CFG.image_tokens, vocab_size=384), data


@pytest.mark.slow  # make test deals fixed-size samples (tests/test_llava_training.py)
def test_native_samples_dealt_across_replicas_keep_the_references_gradient(llava_dataset):
    """DP 2, per-token loss, conversations with images of their own sizes: both replicas'
    samples dealt by encoder load (patches, `encoder_load`), each process sending the samples
    that change replica (patches and grids). Every micro-batch's loss is the one of the
    one-process reference dealing both streams the same way, step 0's gradient the per-token
    reference's on the loader's own micro-batches, and the dealt micro-batches' loads are
    closer than the loader's."""
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.inputs.batches import StepData, encoder_load
    from megatron_mllm.runtime.job import DataParts, ModelParts, PlanParts, RuntimeJob
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.modes.runs import run_rank
    from megatron_mllm.runtime.planning.schedules import runtime_schedule
    from tests.test_runtime import TRAIN, check_against, check_grads

    seq, mb, n = 96, 2, 2
    cfg, data = _native_conversations(llava_dataset, seq)
    train = dict(TRAIN, steps=2)
    state = spawn(make_full_state, 1, cfg, 0)[0]
    plan = ParallelPlan(2, 1, 1)

    def parts(dealt: bool) -> DataParts:
        return DataParts(mb, n, llava=data, per_token_loss=True, balance_samples=dealt)

    refs = [
        spawn(
            run_rank,
            1,
            RuntimeJob(
                ModelParts(cfg, state), PlanParts(plan), parts(dealt), mode="reference", **train
            ),
        )[0]  # fmt: skip
        for dealt in (False, True)
    ]
    spread = []
    for dealt in (False, True):
        stream = StepData(RuntimeJob(ModelParts(cfg, {}), PlanParts(plan), parts(dealt)), [0, 1])
        get = stream.step(0)
        loads = [encoder_load(get(m, dp), cfg) for dp in (0, 1) for m in range(n)]
        assert all(get(m, dp).native for dp in (0, 1) for m in range(n))
        spread.append(max(loads) - min(loads))
        stream.close()
    assert spread[1] < spread[0], spread
    job = RuntimeJob(
        ModelParts(cfg, state),
        PlanParts(plan, schedule=runtime_schedule(cfg, plan, mb, n, "megatron")),
        parts(True),
        **train,
    )
    outs = spawn(run_rank, 2, job)
    one = {"encoder": 1, "projector": 1, "backbone": 1}
    check_against((state, refs[1]), outs, one)
    check_grads((state, refs[0]), outs, one)
    after = {k: v for o in outs for k, v in o["history"][1].items()}
    assert after == pytest.approx(refs[1]["history"][1], abs=1e-4)


@pytest.mark.slow  # the example's own data set is made on first use
def test_the_tiny_qwen_vl_example_trains(tmp_path):
    import os
    import subprocess

    from tests.conftest import ROOT

    env = {**os.environ, "TRAIN_ITERS": "4", "WARMUP": "1", "LOG_INTERVAL": "1",
           "RAW": str(tmp_path / "raw"),
           "DATA_PATH": str(tmp_path / "energon"), "PYTHON": sys.executable}  # fmt: skip
    out = subprocess.run(
        ["bash", str(ROOT / "examples" / "pretrain_qwen_vl_tiny_cpu.sh")],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "iteration        4/       4" in out.stdout and "packed samples:" in out.stdout


@pytest.mark.slow  # the runtime on native packed rows; make test runs each part above
def test_per_step_plans_on_native_packed_rows_keep_the_references_losses(llava_dataset):
    """optimus-adaptive on the native tower with packed conversations and a per-token loss:
    the rows dealt by their patches' cost and each step planned for its micro-batches; step
    0's losses and gradients and the later steps' losses are the one-process reference's,
    which deals the rows the same way."""
    from megatron_mllm.data.llava_source import LlavaData
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.inputs.batches import StepData
    from megatron_mllm.runtime.job import (
        DataParts,
        ExecutorSettings,
        ModelParts,
        PlanParts,
        RuntimeJob,
    )
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.modes.runs import run_rank
    from megatron_mllm.runtime.planning.schedules import runtime_schedule
    from tests.test_runtime import TRAIN, check_against, check_later_losses

    seq, mb, n = 96, 2, 3
    train = dict(TRAIN, steps=3)
    cfg = replace(CFG, text_len=seq - CFG.image_tokens, vocab_size=384)
    path, tokenizer = llava_dataset
    data = LlavaData(str(path), str(tokenizer), seq, num_workers=1, min_pixels=64,
                     max_pixels=2304, packing_buffer_size=8)  # fmt: skip
    parts = DataParts(mb, n, llava=data, per_token_loss=True, balance_samples=True)
    state = spawn(make_full_state, 1, cfg, 0)[0]
    reference = RuntimeJob(ModelParts(cfg, state), PlanParts(ParallelPlan(1, 1, 1)), parts,
                           mode="reference", **train)  # fmt: skip
    ref = spawn(run_rank, 1, reference)[0]
    stream = StepData(reference, [0])
    rows = [stream.step(0)(m) for m in range(n)]
    stream.close()
    assert all(b.native for b in rows) and any(b.segments is not None for b in rows)  # packed
    plan = ParallelPlan(1, 1, 2)
    schedule = runtime_schedule(cfg, plan, mb, n, "optimus", encoder_plan=ParallelPlan(2, 1, 1))
    job = RuntimeJob(ModelParts(cfg, state), PlanParts(plan, schedule=schedule), parts,
                     executor=ExecutorSettings(adaptive=True), **train)  # fmt: skip
    outs = spawn(run_rank, 2, job)
    check_against((state, ref), outs, {"encoder": 1, "projector": 1, "backbone": 1})
    check_later_losses((state, ref), outs)
    stats = outs[0]["step_plans"]
    assert stats.planned == 3 and not stats.failures
