"""Images at their own resolution, prepared as Qwen2-VL's processor prepares them: the resized
size, the patches and their grid equal transformers' processor's."""

import io
import random

import numpy as np
import pytest
import torch

from megatron_mllm.data.native_images import NativeImageSpec, preprocess_native, smart_resize
from megatron_mllm.errors import ConfigError

SPEC = NativeImageSpec(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)


def test_the_resized_size_is_transformers_for_many_sizes():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf

    rng = random.Random(0)
    for _ in range(300):
        h, w = rng.randint(10, 2000), rng.randint(10, 2000)
        expected = hf(h, w, SPEC.factor, SPEC.min_pixels, SPEC.max_pixels)
        assert smart_resize(h, w, SPEC) == expected, (h, w)
    with pytest.raises(ConfigError, match="ratio is over 200"):
        smart_resize(10, 2500, SPEC)


@pytest.mark.parametrize("size", [(50, 70), (30, 100), (400, 260)])
def test_patches_and_grid_are_transformers_processors(size):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(sum(size))
    img = Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    patches, grid = preprocess_native(buf.getvalue(), SPEC)
    hf = Qwen2VLImageProcessorPil(min_pixels=SPEC.min_pixels, max_pixels=SPEC.max_pixels)
    out = hf(images=[img], return_tensors="pt")
    assert list(grid) == out["image_grid_thw"][0].tolist()
    torch.testing.assert_close(patches, out["pixel_values"].float(), rtol=1e-5, atol=1e-5)
