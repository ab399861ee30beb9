"""LLaVA-format training data as a stream of micro-batches: what a run needs to know about it
(`LlavaData`, picklable into every rank) and the per-DP-replica stream over megatron-energon's
savable loader (`LlavaStream`), whose position a checkpoint stores.

Every rank of a DP replica opens the same loader (the replica's DP rank, the same seed), so the
ranks of one pipeline see the same micro-batches, image counts included, without a message; DP
replicas read disjoint samples.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from megatron_mllm.data.batch import MicroBatch
from megatron_mllm.data.pixel_norms import CLIP_MEAN, CLIP_STD, PLAIN_MEAN, PLAIN_STD
from megatron_mllm.data.task_encoder import EncodeSpec

# energon's loader always asks for pinned memory, which torch warns about without a GPU.


@dataclass(frozen=True)
class LlavaData:
    """A prepared energon LLaVA dataset (tools/llava_to_energon.py) and how to encode it."""

    path: str
    tokenizer_model: str  # a local Hugging Face tokenizer directory
    seq_length: int  # the backbone's sequence, image tokens included
    image_token: str | None = None  # the tokenizer's image token (default "<image>")
    loss_on_prompt: bool = False
    num_workers: int = 0
    clip_normalisation: bool = False  # CLIP's mean and std (a CLIP tower), else [-1, 1]
    shuffle_buffer_size: int | None = 64
    max_samples_per_sequence: int | None = 16
    exclude_shards: tuple[str, ...] = ()  # damaged shards left out (energon_llava.DataAccount)
    sources: tuple[str, ...] = ()  # source names, where samples carry source ids (coreset)
    # --packing-buffer-size: training rows pack samples from buffers of this many (else each
    # sample is padded to its own row)
    packing_buffer_size: int | None = None
    # A native-resolution tower (--encoder-arch qwen2vl): --min-pixels / --max-pixels bound
    # each image's resized pixel count (Qwen2-VL's processor's defaults where None).
    min_pixels: int | None = None
    max_pixels: int | None = None

    def spec(
        self, image_tokens: int, image_size: int, packing: bool = False, native=None
    ) -> EncodeSpec:
        """How records are encoded; `native`: a NativeImageSpec of the tower's patches (its
        pixel bounds are this data's, where given)."""
        from dataclasses import replace

        from megatron_mllm.data.tokenizer import load_tokenizer

        if native is not None:
            bounds = {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}
            native = replace(native, **{k: v for k, v in bounds.items() if v is not None})
        return EncodeSpec(
            load_tokenizer(self.tokenizer_model, self.image_token),
            self.seq_length,
            image_tokens,
            image_size,
            CLIP_MEAN if self.clip_normalisation else PLAIN_MEAN,
            CLIP_STD if self.clip_normalisation else PLAIN_STD,
            self.loss_on_prompt,
            self.sources,
            packing,
            native,
        )


@contextlib.contextmanager
def rng_untouched():
    """Python's, NumPy's and torch's global RNG states are what they were before: a loader
    that seeds or draws from them while it starts (torch's data loader draws its workers' base
    seed; energon sets the RNG state it saved) leaves training's streams, dropout included,
    as an uninterrupted run has them, wherever the loader starts."""
    import random

    import numpy as np
    import torch

    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


class LlavaStream:
    """One DP replica's micro-batches, step after step, from `split` of the dataset."""

    def __init__(
        self,
        data: LlavaData,
        split: str,
        dp_rank: int,
        dp_size: int,
        micro_batch: int,
        image_tokens: int,
        image_size: int,
        seed: int,
        native=None,
    ) -> None:
        from megatron_mllm.data.energon_loader import (
            LlavaTaskEncoder,
            PackingTaskEncoder,
            open_loader,
        )

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked
        self.split, self.micro_batch = split, micro_batch
        packing = data.packing_buffer_size is not None and split == "train"
        encoder = PackingTaskEncoder if packing else LlavaTaskEncoder
        self.loader = open_loader(
            data.path,
            split,
            encoder(data.spec(image_tokens, image_size, packing, native)),
            dp_rank=dp_rank,
            dp_size=dp_size,
            batch_size=micro_batch,
            num_workers=data.num_workers,
            seed=seed,
            shuffle_buffer_size=data.shuffle_buffer_size if split == "train" else None,
            max_samples_per_sequence=data.max_samples_per_sequence if split == "train" else None,
            exclude_shards=data.exclude_shards,
            packing_buffer_size=data.packing_buffer_size if packing else None,
        )
        self._it = None
        self.corrupted = 0  # samples skipped so far: a member that does not decode
        self.truncated = 0  # samples cut to the sequence length so far
        self.no_answer = 0  # of those, samples left without an answer token
        self.samples = 0  # samples read so far (a packed row holds several)

    def next(self) -> MicroBatch:
        """The next micro-batch. A validation stream starts over after its last and skips the
        short batches energon forms at the end of each worker's share (the schedule's
        messages have one micro-batch size)."""
        restarts = 0
        while True:
            try:
                with rng_untouched():  # the loader's start and reads draw on no global RNG
                    if self._it is None:
                        self._it = iter(self.loader)
                    batch = next(self._it)
            except StopIteration:
                if self.split == "train" or restarts:
                    raise RuntimeError(f"the {self.split} split has no full micro-batch") from None
                self._it, restarts = None, restarts + 1
                continue
            self._skipped(batch.corrupted)
            if batch.num_samples == self.micro_batch:
                self.truncated += batch.truncated
                self.no_answer += batch.no_answer
                self.samples += len(batch.ids)
                return batch

    def _skipped(self, names: tuple[str, ...]) -> None:
        """Count (and name, once, on this rank's stderr) samples the loader skipped."""
        import sys

        for name in names:
            self.corrupted += 1
            print(f"WARNING: {self.split} data: skipped {name}", file=sys.stderr, flush=True)

    def take(self, n: int) -> list[MicroBatch]:
        return [self.next() for _ in range(n)]

    def state(self) -> dict:
        """The position (energon's per-rank loader state) and the truncation counts."""
        from megatron_mllm.data.energon_loader import loader_state

        return {
            "loader": loader_state(self.loader),
            "truncated": self.truncated,
            "no_answer": self.no_answer,
            "corrupted": self.corrupted,
            "samples": self.samples,
        }

    def restore(self, state: dict) -> None:
        """Continue from `state` (a fresh stream, before its first micro-batch)."""
        from megatron_mllm.data.energon_loader import restore_loader

        restore_loader(self.loader, state["loader"])
        self.truncated = state["truncated"]
        self.no_answer = state.get("no_answer", 0)  # absent in older checkpoints
        self.corrupted = state.get("corrupted", 0)
        self.samples = state.get("samples", 0)  # absent before packing

    def close(self) -> None:
        from megatron_mllm.data.energon_loader import close_loader

        close_loader(self.loader)
