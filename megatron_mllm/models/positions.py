"""Rotary positions of the backbone's tokens, computed on the device from the micro-batch (no
host synchronisation): 1-D positions (restarting per sample in packed rows) and Qwen2-VL's
multimodal positions, where an image's tokens sit on their (height, width) grid and the text
after an image continues past its larger side (as Hugging Face's `get_rope_index` places them).
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on a GPU from pinned memory without blocking the host (the copy
    is ordered on the current stream before any use)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _before_in_sample(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per token, the count of `x` (0/1, [b, s]) before it in its own sample (the sample
    starts where `positions` is 0)."""
    total = torch.cumsum(x, dim=1) - x  # exclusive, over the whole row
    start = torch.arange(x.shape[1], device=x.device) - positions  # each token's sample start
    return total - total.gather(1, start)


def mrope_position_ids(
    image_mask: torch.Tensor, positions: torch.Tensor, grid: tuple[int, int]
) -> torch.Tensor:
    """[3, b, s] temporal, height and width positions. `image_mask` [b, s] marks image tokens,
    each image a run of rows x columns = `grid` tokens in row-major order; `positions` [b, s]
    are the 1-D positions (0 where each sample starts)."""
    rows, cols = grid
    per_image, side = rows * cols, max(rows, cols)
    image = image_mask.long()
    text_before = _before_in_sample(1 - image, positions)
    image_before = _before_in_sample(image, positions)  # image tokens before, in the sample
    base = text_before + (image_before // per_image) * side
    k = image_before % per_image  # an image token's place in its image
    is_image = image_mask
    height = torch.where(is_image, base + k // cols, base)
    width = torch.where(is_image, base + k % cols, base)
    return torch.stack([base, height, width])


def native_mrope_position_ids(
    image_mask: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor
) -> torch.Tensor:
    """`mrope_position_ids` for images of their own sizes: `grids` [n, 2] each image's (rows,
    columns) of backbone tokens, the images in the micro-batch's order (row by row)."""
    device = image_mask.device
    rows, cols = to_device(grids[:, 0], device), to_device(grids[:, 1], device)
    ends = torch.cumsum(rows * cols, 0)
    image = image_mask.long()
    rank = (torch.cumsum(image.flatten(), 0) - 1).view_as(image)  # among the image tokens
    owner = torch.searchsorted(ends, rank.clamp(min=0), right=True).clamp(max=len(ends) - 1)
    k = rank - (ends - rows * cols)[owner]  # an image token's place in its image
    side = torch.maximum(rows, cols)[owner]
    first = image * (k == 0)  # each image's first token carries its larger side
    sides_before = _before_in_sample(first * side, positions) - image * (k > 0) * side
    base = _before_in_sample(1 - image, positions) + sides_before
    width = cols[owner]
    height = torch.where(image_mask, base + k // width, base)
    return torch.stack([base, height, torch.where(image_mask, base + k % width, base)])
