"""A native-resolution tower's load (schedule/patch_loads.py): GEMMs per patch, attention over
the micro-batch's masked sequence (megatron-core's local path) or per image and window (a
variable-length kernel); and a run's planned load, from the records' image sizes the conversion
sampled or from the synthetic images' sizes."""

import math
from dataclasses import replace

import pytest

from megatron_mllm.models.config import TINY
from megatron_mllm.schedule.patch_loads import (
    TowerShape,
    expected_load,
    microbatch_load,
)

SHAPE = TowerShape(hidden=64, ffn=256, layers=4)
QWEN_ARGS = ["--encoder-arch", "qwen2vl", "--patch-dim", "4", "--img-h", "16", "--mrope-section",
             "2", "3", "3", "--add-qkv-bias", "--disable-bias-linear", "--normalization",
             "RMSNorm", "--swiglu"]  # fmt: skip


def test_a_micro_batch_costs_gemms_per_patch_and_attention_over_its_masked_sequence():
    h, f = 64, 256
    per_patch = 4 * (4 * h * h + 2 * h * f)
    assert SHAPE.nominal_cost((16, 16)) == per_patch * 256 + 4 * 2 * h * 256**2
    assert microbatch_load(SHAPE, [[(8, 8)], [(8, 8)]], (8, 8)) == pytest.approx(
        (per_patch * 128 + 4 * 2 * h * 128**2) / (2 * SHAPE.nominal_cost((8, 8)))
    )  # the two images are one masked sequence: more than two nominal samples
    apart = replace(SHAPE, masked=False)
    assert microbatch_load(apart, [[(8, 8)], [(8, 8)]], (8, 8)) == 1.0
    assert microbatch_load(SHAPE, [[(8, 8)]], (8, 8)) == 1.0
    gated = replace(SHAPE, gated=True)
    assert gated.nominal_cost((8, 8)) - SHAPE.nominal_cost((8, 8)) == 4 * 64 * (h * f)


def test_windows_tile_the_merged_grid_and_full_layers_attend_the_whole_image():
    shape = TowerShape(hidden=32, ffn=64, layers=4, merge=2, window=2, full_layers=1, masked=False)
    # A 10 x 6 patch grid: 5 x 3 merged tokens in windows of 2 x 2 (cut at the edges).
    lengths = shape.window_lengths(10, 6)
    assert lengths == [16, 8, 16, 8, 8, 4] and sum(lengths) == 60
    whole = replace(shape, window=0)
    assert shape.image_attention((4, 4)) == whole.image_attention((4, 4))  # one window
    expected = 2 * 32 * (60**2 + 3 * sum(x * x for x in lengths))
    assert shape.image_attention((10, 6)) == expected < whole.image_attention((10, 6))
    masked = replace(shape, masked=True)  # the local path computes the whole sequence anyway
    assert masked.microbatch_cost([[(10, 6)]]) == whole.microbatch_cost([[(10, 6)]])


def test_the_expected_load_is_the_mean_over_random_micro_batches():
    records = [[(4, 4)], [(8, 8), (4, 4)], [], [(12, 4)]]
    for shape in (SHAPE, replace(SHAPE, masked=False)):
        for b in (1, 2, 3):
            exact = expected_load(shape, records, b, (8, 8))
            # every ordered draw of b records with replacement, equally likely
            draws = [[]]
            for _ in range(b):
                draws = [d + [r] for d in draws for r in records]
            mean = math.fsum(microbatch_load(shape, d, (8, 8)) for d in draws) / len(draws)
            assert exact == pytest.approx(mean, rel=1e-12), (shape.masked, b)
    assert expected_load(SHAPE, [], 2, (8, 8)) == 1.0


def test_the_configs_tower_shape_is_its_model():
    cfg = replace(TINY, vit_native=True, vit_swiglu=True, patch_size=4, vit_merge=2,
                  vit_window=16, vit_full_layers=(1,), vit_ffn=40)  # fmt: skip
    shape = cfg.tower_shape()
    assert (shape.hidden, shape.ffn, shape.layers, shape.gated) == (
        cfg.vit_hidden, 40, cfg.vit_layers, True
    )  # fmt: skip
    assert (shape.window, shape.full_layers, shape.merge) == (2, 1, 2)  # 16 px = 2 merged tokens


def test_synthetic_native_runs_plan_for_their_images_sizes():
    from megatron_mllm.data.synthetic import native_records
    from megatron_mllm.training.run_config import parse_run

    args = [*QWEN_ARGS, "--global-batch-size", "8", "--micro-batch-size", "2"]
    run = parse_run(args, world_size=1)
    records = native_records(run.model)
    assert sorted({g for r in records for g in r}) == [(h, w) for h in (2, 4) for w in (2, 4)]
    assert sum(not r for r in records) * 4 == len(records)  # every fourth sample text only
    expected = expected_load(run.model.tower_shape(), records, 2, (4, 4))
    assert run.images_per_sample == expected < 1.0  # smaller than the nominal 16-pixel image


def test_conversation_runs_plan_for_the_data_sets_image_sizes(llava_dataset):
    """The planned load from the records' sizes the conversion sampled equals one computed here
    from the LLaVA file and its image files."""
    from PIL import Image

    from megatron_mllm.data.energon_llava import record_image_sizes
    from megatron_mllm.data.llava import image_path, read_records
    from megatron_mllm.data.native_images import NativeImageSpec, smart_resize
    from megatron_mllm.training.run_config import parse_run

    data, tokenizer = llava_dataset
    args = [*QWEN_ARGS, "--global-batch-size", "8", "--micro-batch-size", "2",
            "--data-path", str(data), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tokenizer), "--seq-length", "128", "--min-pixels", "64",
            "--max-pixels", "2304", "--num-workers", "0"]  # fmt: skip
    run = parse_run(args, world_size=1)
    src = data.parent / "src"
    records = []
    for record in read_records(src / "llava.json"):
        sizes = []
        for name in record.images:
            with Image.open(image_path(record.id, src / "images", name)) as img:
                sizes.append((img.height, img.width))
        records.append(sizes)
    assert sorted(record_image_sizes(data)) == sorted(records)  # 60 records: all kept
    spec = NativeImageSpec(4, 2, 2, min_pixels=64, max_pixels=2304)
    grids = [[tuple(x // 4 for x in smart_resize(h, w, spec)) for h, w in r] for r in records]
    expected = expected_load(run.model.tower_shape(), grids, 2, (4, 4))
    assert run.images_per_sample == pytest.approx(expected, rel=1e-12)
    assert run.images_per_sample > 2  # the digits are mostly larger than 16 x 16 pixels


def test_a_calibrated_tower_recovers_its_fixed_work_and_attention_scale():
    """Two measured sizes fix the fixed work per micro-batch and the attention's scale: ratios
    made by a known shape give that shape back, and then every other size's cost too."""
    from dataclasses import replace

    from megatron_mllm.schedule.patch_loads import TowerShape, calibrated, microbatch_load

    plain = TowerShape(256, 1024, 4)
    truth = replace(plain, fixed=3e7, attention_scale=2.0)
    nominal = (16, 16)
    measured = {g: microbatch_load(truth, [[g]], nominal) for g in ((8, 8), (16, 48))}
    got = calibrated(plain, nominal, measured)
    assert got.fixed == pytest.approx(3e7) and got.attention_scale == pytest.approx(2.0)
    for grids in ([[(32, 32)]], [[(16, 16), (16, 16)]], [[(16, 16)], [(8, 16)]]):
        assert microbatch_load(got, grids, nominal) == pytest.approx(
            microbatch_load(truth, grids, nominal)
        )
    # Ratios no positive fixed work and scale explain: the plain shape back.
    assert calibrated(plain, nominal, {(8, 8): 0.01, (16, 48): 3.0}) == plain


def test_a_profiled_tower_costs_what_was_measured_at_each_size_and_between():
    """The tower's seconds at a few patch counts (the nominal's among them) give each count's
    ratio to the flop count: a micro-batch of a profiled count costs its measured multiple of
    the nominal image, one between two counts the interpolated ratio, one beyond the last the
    last ratio; the expected load follows the profile."""
    from megatron_mllm.schedule.patch_loads import profiled

    plain, nominal = TowerShape(256, 1024, 4), (8, 8)
    flops = plain.masked_cost
    # 20% over the flop count at 16 patches (dispatch), exact at 64, 1.5x at 1024 (caches)
    seconds = {16: 1.2 * flops(16), 64: flops(64), 1024: 1.5 * flops(1024)}
    got = profiled(plain, nominal, {n: 1e-9 * s for n, s in seconds.items()})
    assert [n for n, _ in got.profile] == [16, 64, 1024]
    assert [f for _, f in got.profile] == pytest.approx([1.2, 1.0, 1.5])
    for n, s in seconds.items():
        side = int(math.sqrt(n))
        assert microbatch_load(got, [[(side, side)]], nominal) == pytest.approx(s / flops(64))
    middle = 64 + (1024 - 64) // 2  # halfway: the ratio halfway, 1.25
    assert got.masked_cost(middle) == pytest.approx(1.25 * flops(middle))
    assert got.masked_cost(4096) == pytest.approx(1.5 * flops(4096))
    assert got.masked_cost(4) == pytest.approx(1.2 * flops(4))
    records = [[(8, 8)], [(32, 32)], [], [(4, 4), (8, 8)]]
    drawn = expected_load(got, records, 2, nominal)
    flat = expected_load(plain, records, 2, nominal)
    assert drawn > flat  # the large images cost 1.5x their flops
    exact = math.fsum(got.microbatch_cost([a, b]) for a in records for b in records) / (
        16 * 2 * got.nominal_cost(nominal)
    )
    assert drawn == pytest.approx(exact, rel=0.03)  # the mean over drawn micro-batches
    with pytest.raises(ValueError, match="nominal image's 64 patches"):
        profiled(plain, nominal, {16: 1.0, 1024: 2.0})


def test_encoder_loads_follow_the_towers_profile_in_the_measured_times():
    """`encoder_load` reads the tower's profile from the measured unit times where there is
    one: a micro-batch is weighed by the profiled cost, else by the flop count."""
    from megatron_mllm.data.synthetic import native_microbatch
    from megatron_mllm.runtime.inputs.batches import encoder_load, tower_cost

    cfg = replace(TINY, vit_native=True, patch_size=4, image_size=16, llm_mrope_section=(2, 3, 3))
    shape, side = cfg.tower_shape(), cfg.image_size // cfg.patch_size

    def patches(batch) -> int:
        return sum(h * w for row in batch.row_grids() for h, w in row)

    # a micro-batch heavier than the nominal image (where the profile weighs it)
    batch = next(b for i in range(50) if patches(b := native_microbatch(cfg, i, 2, 0)) > 16)
    grids = batch.row_grids()
    flat = encoder_load(batch, cfg)
    assert flat == pytest.approx(shape.microbatch_cost(grids) / shape.nominal_cost((side, side)))
    n0 = side * side
    # at 4x the batch's patches the tower took twice its flop count's share
    most = 4 * patches(batch)
    twice = 2 * shape.masked_cost(most) / shape.masked_cost(n0)
    times = {"vit": {"forward": {}, "tower": [[n0, 1.0], [most, twice]]}}
    assert tower_cost(cfg, times).profile_factor(most) == pytest.approx(2.0)
    assert flat < encoder_load(batch, cfg, times) < 2 * flat
    assert encoder_load(batch, cfg, {"vit": {"forward": {}}}) == flat
