"""A native-resolution tower's load per image (schedule/patch_loads.py): linear parts per patch,
attention per image or per window; and the planned load of a run, from the data set's own image
sizes (recorded when it was converted) or from the synthetic images' sizes."""

import math
from dataclasses import replace

import pytest

from megatron_mllm.models.config import TINY
from megatron_mllm.schedule.patch_loads import TowerShape, image_load, mean_image_load

SHAPE = TowerShape(hidden=64, ffn=256, layers=4)
QWEN_ARGS = ["--encoder-arch", "qwen2vl", "--patch-dim", "4", "--img-h", "16", "--mrope-section",
             "2", "3", "3", "--add-qkv-bias", "--disable-bias-linear", "--normalization",
             "RMSNorm", "--swiglu"]  # fmt: skip


def test_an_image_costs_its_gemms_per_patch_and_its_attention_per_image():
    h, f, n = 64, 256, 16 * 16
    per_layer = n * (4 * h * h + 2 * h * f) + 2 * h * n * n
    assert SHAPE.image_cost(16, 16) == 4 * per_layer
    assert image_load(SHAPE, (8, 8), (8, 8)) == 1.0
    # Four times the patches: four times the GEMMs, sixteen times the attention.
    small, large = SHAPE.image_cost(8, 8), SHAPE.image_cost(16, 16)
    assert 4 < large / small < 16
    gated = replace(SHAPE, gated=True)
    assert gated.image_cost(8, 8) - small == 4 * 64 * (h * f)  # the gate's GEMM


def test_windows_tile_the_merged_grid_and_full_layers_attend_the_whole_image():
    shape = TowerShape(hidden=32, ffn=64, layers=4, merge=2, window=2, full_layers=1)
    # A 10 x 6 patch grid: 5 x 3 merged tokens in windows of 2 x 2 (cut at the edges).
    lengths = shape.window_lengths(10, 6)
    assert lengths == [16, 8, 16, 8, 8, 4]
    assert sum(lengths) == 60
    whole = replace(shape, window=0)
    assert shape.image_cost(4, 4) == whole.image_cost(4, 4)  # one window is the whole image
    assert shape.image_cost(10, 6) < whole.image_cost(10, 6)
    linear = 60 * (4 * 32 * 32 + 2 * 32 * 64)
    expected = 4 * linear + 2 * 32 * 60**2 + 3 * 2 * 32 * sum(x * x for x in lengths)
    assert shape.image_cost(10, 6) == expected
    assert mean_image_load(shape, [], (4, 4)) == 1.0


def test_the_configs_tower_shape_is_its_model():
    cfg = replace(TINY, vit_native=True, vit_swiglu=True, patch_size=4, vit_merge=2,
                  vit_window=16, vit_full_layers=(1,), vit_ffn=40)  # fmt: skip
    shape = cfg.tower_shape()
    assert (shape.hidden, shape.ffn, shape.layers, shape.gated) == (
        cfg.vit_hidden, 40, cfg.vit_layers, True
    )  # fmt: skip
    assert (shape.window, shape.full_layers, shape.merge) == (2, 1, 2)  # 16 px = 2 merged tokens


def test_synthetic_native_runs_plan_for_their_images_sizes():
    from megatron_mllm.data.synthetic import native_grids
    from megatron_mllm.training.run_config import parse_run

    run = parse_run([*QWEN_ARGS, "--global-batch-size", "8"], world_size=1)
    grids = native_grids(run.model)
    assert sorted(set(grids)) == [(h, w) for h in (2, 4) for w in (2, 4)]  # sides 8, 16 px
    shape = run.model.tower_shape()
    expected = 0.75 * sum(image_load(shape, g, (4, 4)) for g in grids) / len(grids)
    assert run.images_per_sample == pytest.approx(expected, rel=1e-12)
    assert run.images_per_sample < 0.75  # smaller than the nominal 16-pixel image


def test_conversation_runs_plan_for_the_data_sets_image_sizes(llava_dataset):
    """The planned load from the sizes the conversion recorded equals one computed here from
    the image files themselves."""
    from PIL import Image

    from megatron_mllm.data.energon_llava import image_sizes, images_per_sample
    from megatron_mllm.data.native_images import NativeImageSpec, smart_resize
    from megatron_mllm.training.run_config import parse_run

    data, tokenizer = llava_dataset
    args = [*QWEN_ARGS, "--global-batch-size", "8", "--data-path", str(data),
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
            "--seq-length", "128", "--min-pixels", "64", "--max-pixels", "2304",
            "--num-workers", "0"]  # fmt: skip
    run = parse_run(args, world_size=1)
    files = sorted((data.parent / "src" / "images").iterdir())
    sizes = []
    for f in files:
        with Image.open(f) as img:
            sizes.append((img.height, img.width))
    assert sorted(image_sizes(data)) == sorted(sizes)  # 60 records: every image is kept
    spec = NativeImageSpec(4, 2, 2, min_pixels=64, max_pixels=2304)
    grids = [tuple(x // 4 for x in smart_resize(h, w, spec)) for h, w in sizes]
    shape = run.model.tower_shape()
    mean = math.fsum(image_load(shape, g, (4, 4)) for g in grids) / len(grids)
    assert run.images_per_sample == pytest.approx(images_per_sample(data) * mean, rel=1e-12)
    assert run.images_per_sample > 2 * images_per_sample(data)  # most images beat 16 x 16
