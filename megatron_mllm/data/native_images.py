"""Images at their own resolution, as Qwen2-VL's processor prepares them: resized (bicubic) so
that each side is a multiple of patch x merge and the pixel count stays within
[min_pixels, max_pixels] at about the same aspect ratio, normalised with CLIP's mean and std,
and cut into patches in merge-window order (`models/qwen2_vision.py` reads them in that order),
each patch repeated over the temporal patch depth as a still image is."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import torch

from megatron_mllm.data.pixel_norms import CLIP_MEAN, CLIP_STD
from megatron_mllm.errors import ConfigError


@dataclass(frozen=True)
class NativeImageSpec:
    """How images are cut (Qwen2-VL's processor defaults)."""

    patch_size: int = 14
    merge: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    channels: int = 3

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal_patch_size * self.patch_size**2


def smart_resize(height: int, width: int, spec: NativeImageSpec) -> tuple[int, int]:
    """The size an image of `height` x `width` is resized to (see the module docstring)."""
    f = spec.factor
    if max(height, width) > 200 * min(height, width):
        raise ConfigError(
            f"an image of {height} x {width} pixels: its sides' ratio is over 200, which "
            "Qwen2-VL's processor refuses; crop or pad it"
        )
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > spec.max_pixels:
        scale = math.sqrt(height * width / spec.max_pixels)
        h = max(f, math.floor(height / scale / f) * f)
        w = max(f, math.floor(width / scale / f) * f)
    elif h * w < spec.min_pixels:
        scale = math.sqrt(spec.min_pixels / (height * width))
        h, w = math.ceil(height * scale / f) * f, math.ceil(width * scale / f) * f
    return h, w


def patchify(image: torch.Tensor, spec: NativeImageSpec) -> tuple[torch.Tensor, tuple]:
    """[C, H, W] (sides multiples of the factor) -> ([patches, C * T * P * P], (1, rows,
    columns)): patches in merge-window order, each repeated over the temporal depth."""
    c, height, width = image.shape
    p, m, t = spec.patch_size, spec.merge, spec.temporal_patch_size
    rows, cols = height // p, width // p
    x = image.reshape(c, rows // m, m, p, cols // m, m, p)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # windows (rows, cols), in-window (rows, cols), C, P, P
    x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)
    return x.reshape(rows * cols, c * t * p * p), (1, rows, cols)


def preprocess_native(data: bytes, spec: NativeImageSpec) -> tuple[torch.Tensor, tuple]:
    """Encoded image bytes -> (patches, grid): decoded with Pillow, RGB, resized, normalised
    with CLIP's mean and std, patchified."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        h, w = smart_resize(rgb.height, rgb.width, spec)
        rgb = rgb.resize((w, h), Image.BICUBIC)
        pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    x = pixels.view(h, w, 3).permute(2, 0, 1).float() / 255.0
    x = (x - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
    return patchify(x, spec)
