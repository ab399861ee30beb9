"""Deterministic synthetic image-text micro-batches (for tests, benchmarks and the demo: no
downloads). Learnable: each sample has a class; its image is the class's pattern plus noise and
its caption is the class's token sequence, so the first caption token must be read from the
image through the encoder."""

from __future__ import annotations

from typing import Protocol

import torch


class Sizes(Protocol):
    """What the synthetic data reads of a model's configuration (an MLLMConfig has them)."""

    channels: int
    image_size: int
    text_len: int
    vocab_size: int


NUM_CLASSES = 10
HOST = "cpu"  # batches are made on the host; each run mode moves them to its device


def _patterns(cfg: Sizes) -> torch.Tensor:
    g = torch.Generator().manual_seed(12345)
    return torch.randn(
        NUM_CLASSES, cfg.channels, cfg.image_size, cfg.image_size, generator=g, device=HOST
    )


def microbatch(
    cfg: Sizes, index: int, micro_batch: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch `index`: images [b, c, H, W] and text tokens [b, text_len].

    The same index gives the same tensors in every process, whatever the parallel layout.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    classes = torch.randint(0, NUM_CLASSES, (micro_batch,), generator=g, device=HOST)
    shape = (micro_batch, cfg.channels, cfg.image_size, cfg.image_size)
    noise = torch.randn(shape, generator=g, device=HOST)
    images = _patterns(cfg)[classes] + 0.5 * noise
    steps = torch.arange(cfg.text_len, device=HOST)
    text = (classes[:, None] * 7 + steps[None, :] * (classes[:, None] + 1)) % cfg.vocab_size
    return images, text


def samples(
    cfg: Sizes, indices: list[int], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Individually indexed samples (for coreset pools): images, captions and their class as the
    source id. Classes are imbalanced (probability ~ 1 / (class + 1)), like a real mixture."""
    probs = 1.0 / torch.arange(1, NUM_CLASSES + 1, dtype=torch.float64, device=HOST)
    patterns = _patterns(cfg)
    steps = torch.arange(cfg.text_len, device=HOST)
    images, texts, classes = [], [], []
    for i in indices:
        g = torch.Generator().manual_seed(seed * 1_000_003 + 7_777_777 + i)
        c = torch.multinomial(probs, 1, generator=g)
        noise = torch.randn(
            1, cfg.channels, cfg.image_size, cfg.image_size, generator=g, device=HOST
        )
        images.append(patterns[c] + 0.5 * noise)
        texts.append(((c * 7 + steps * (c + 1)) % cfg.vocab_size).unsqueeze(0))
        classes.append(c)
    return torch.cat(images), torch.cat(texts), torch.cat(classes)


def native_records(cfg) -> list[list[tuple[int, int]]]:
    """The synthetic native samples' image grids, each record as likely as the samples are:
    every grid the sides allow, three samples of four with one image, the fourth none."""
    factor = cfg.patch_size * cfg.vit_merge
    sides = [k * factor // cfg.patch_size for k in range(1, cfg.image_size // factor + 1)]
    grids = [(h, w) for h in sides for w in sides]
    return [[g] for g in grids for _ in range(3)] + [[] for _ in grids]


def native_microbatch(cfg, index: int, micro_batch: int, seed: int = 0):
    """Global micro-batch `index` for a native-resolution tower (`cfg.vit_native`): each
    sample one image of its own size (sides drawn from the multiples of patch x merge up to
    `cfg.image_size`; every fourth sample text only), its class's pattern cropped to that size
    plus noise, cut into patches; its tokens first, then the caption, padded to the sequence."""
    from megatron_mllm.data.batch import IGNORE_INDEX, MicroBatch
    from megatron_mllm.data.native_images import NativeImageSpec, patchify

    spec = NativeImageSpec(cfg.patch_size, cfg.vit_merge, cfg.vit_temporal_patch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    images, text = microbatch(cfg, index, micro_batch, seed)
    sides = cfg.image_size // spec.factor
    seq, b = cfg.seq_len, micro_batch
    tokens = torch.zeros(b, seq, dtype=torch.long)
    labels = torch.full((b, seq), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(b, seq, dtype=torch.bool)
    patches, grids = [], []
    for i in range(b):
        n = 0
        if (index * b + i) % 4 != 3:  # see native_records
            h, w = (int(torch.randint(1, sides + 1, (1,), generator=g)) * spec.factor for _ in "hw")
            cut, grid = patchify(images[i, :, :h, :w], spec)
            patches.append(cut)
            grids.append(grid)
            n = grid[1] * grid[2] // spec.merge**2
            mask[i, :n] = True
        t = text.shape[1]
        tokens[i, n : n + t] = text[i]
        labels[i, max(n - 1, 0) : n + t - 1] = text[i, int(n == 0) :]  # next-token targets
    return MicroBatch(
        torch.cat(patches) if patches else torch.zeros(0, cfg.patch_dim),
        tokens,
        labels,
        mask,
        grids=torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
        merge=spec.merge,
    )
