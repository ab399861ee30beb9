"""What one micro-batch carries to the model, for every data source (synthetic, shards, LLaVA
conversations): the images of its samples however many (zero, one or several per sample), the
token ids with the image positions marked, and the labels.

`labels[i, j]` is the target of the prediction at position j (the next token), `IGNORE_INDEX`
where there is none (prompt turns, image tokens, padding). The encoders' output for image k of
the micro-batch replaces the k-th run of `image_tokens` marked positions, in sample order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MicroBatch:
    images: torch.Tensor  # [n, c, H, W]: every image of the micro-batch, sample by sample
    tokens: torch.Tensor  # [b, s] token ids (the image positions hold the image token)
    labels: torch.Tensor  # [b, s] next-token targets, IGNORE_INDEX where no loss
    image_mask: torch.Tensor  # [b, s] bool: where image embeddings go
    ids: tuple[str, ...] = field(default=())  # sample ids (real data)
    truncated: int = 0  # samples cut to the sequence length
    no_answer: int = 0  # of those, samples the cut left without any answer token
    image_tokens: int = 0  # positions per image (checked against the mask on the host)
    sources: tuple[int, ...] = field(default=())  # each sample's source id (coreset budgets)
    # samples the loader's worker skipped before this batch: a member that does not decode
    corrupted: tuple[str, ...] = field(default=())
    # Packed rows (`pack`): [b, s] each position's index in its own sample (positions restart
    # per sample) and which sample of the row it belongs to (-1: padding). None: one sample a
    # row, positions 0..s-1.
    positions: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    # Native-resolution images (`data/native_images.py`): `images` is then every image's patches
    # [patches, patch_dim], `grids` [n, 3] each image's (frames, rows, columns) of patches (on
    # the host: masks and positions are made from it there), `merge` the patches a backbone
    # token merges along each side.
    grids: torch.Tensor | None = None
    merge: int = 1

    def __post_init__(self) -> None:
        if self.image_mask.device.type != "cpu" or not (self.image_tokens or self.native):
            return
        marked = int(self.image_mask.sum())
        wanted = int(self.tokens_per_image().sum()) if self.native else 0
        wanted = wanted or self.num_images * self.image_tokens
        if marked != wanted:
            raise ValueError(f"{marked} image positions for {self.num_images} images")

    @property
    def native(self) -> bool:
        return self.grids is not None

    @property
    def num_images(self) -> int:
        return self.grids.shape[0] if self.native else self.images.shape[0]

    def tokens_per_image(self) -> torch.Tensor:
        """Native-resolution images: each one's backbone tokens (its merged windows), host."""
        return self.grids[:, 0] * self.grids[:, 1] * self.grids[:, 2] // self.merge**2

    def row_images(self) -> list[range]:
        """Each row's images, as indices into the micro-batch's images (host)."""
        if not self.native:
            if self.num_images and not self.image_tokens:
                raise ValueError("a micro-batch with images but no image_tokens per image")
            counts = (self.image_mask.sum(1) // max(self.image_tokens, 1)).tolist()
        else:
            sizes, counts, k = self.tokens_per_image().tolist(), [], 0
            for marked in self.image_mask.sum(1).tolist():
                start = k
                while marked > 0:
                    marked -= sizes[k]
                    k += 1
                counts.append(k - start)
        ends = list(accumulate(counts))
        return [range(end - n, end) for end, n in zip(ends, counts, strict=True)]

    def row_grids(self) -> list[list[tuple[int, int]]]:
        """Native-resolution images: each row's images as (rows, columns) of patches over their
        frames (a packed row's samples together), host."""
        g = self.grids.tolist()
        return [[(g[i][0] * g[i][1], g[i][2]) for i in row] for row in self.row_images()]

    @property
    def num_samples(self) -> int:
        return self.tokens.shape[0]

    @property
    def labelled_tokens(self) -> int:
        """Positions with a target (what a per-token loss is normalised by); read on the host,
        so call it on the CPU batch the loader gave."""
        return int((self.labels != IGNORE_INDEX).sum())

    def images_per_sample(self) -> list[int]:
        """Each sample's (row's) image count."""
        return [len(r) for r in self.row_images()]

    def to(self, device: torch.device, dtype: torch.dtype) -> MicroBatch:
        """On `device`, images in the pipeline dtype; to a GPU from pinned host memory without
        blocking the host (the copies are ordered on the current stream before any use)."""
        device = torch.device(device)
        gpu = device.type == "cuda"

        def move(t: torch.Tensor, dt: torch.dtype | None = None) -> torch.Tensor:
            if gpu and t.device.type == "cpu":
                t = t.pin_memory()
            return t.to(device, dt, non_blocking=gpu)

        packed = self.segments is not None
        return replace(
            self,
            images=move(self.images, dtype),
            tokens=move(self.tokens),
            labels=move(self.labels),
            image_mask=move(self.image_mask),
            positions=move(self.positions) if packed else None,
            segments=move(self.segments) if packed else None,
        )

    @property
    def packed(self) -> bool:
        return self.segments is not None

    def position_ids(self) -> torch.Tensor:
        """[b, s] each token's position in its sample (0..s-1 in every row where unpacked)."""
        if self.positions is not None:
            return self.positions
        b, s = self.tokens.shape
        return torch.arange(s, device=self.tokens.device).expand(b, s)

    def attention_mask(self) -> torch.Tensor:
        """megatron-core's boolean mask (True: not allowed), causal and, in packed rows, only
        within a sample: [1, 1, s, s] unpacked, [b, 1, s, s] packed."""
        s = self.tokens.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=self.tokens.device).triu(1)
        if self.segments is None:
            return causal[None, None]
        other = self.segments[:, :, None] != self.segments[:, None, :]
        return (causal[None] | other).unsqueeze(1)

    def select(self, rows: list[int]) -> MicroBatch:
        """The samples (rows) `rows` and their images as a micro-batch."""
        images = self.row_images()
        picked = [i for r in rows for i in images[r]]
        grids = {}
        if self.native:  # each image's run of patches
            cells = self.grids.prod(1).tolist()
            ends = list(accumulate(cells))
            grids = {"grids": self.grids[picked] if picked else self.grids[:0]}
            picked = [p for i in picked for p in range(ends[i] - cells[i], ends[i])]
        index = torch.tensor(rows, dtype=torch.long, device=self.tokens.device)
        return replace(
            self,
            images=self.images[torch.tensor(picked, dtype=torch.long, device=self.images.device)],
            **grids,
            tokens=self.tokens[index],
            labels=self.labels[index],
            image_mask=self.image_mask[index],
            ids=tuple(self.ids[r] for r in rows) if self.ids else (),
            sources=tuple(self.sources[r] for r in rows) if self.sources else (),
            truncated=0,
            no_answer=0,
            positions=None if self.positions is None else self.positions[index],
            segments=None if self.segments is None else self.segments[index],
        )


def image_then_text(images: torch.Tensor, text: torch.Tensor, image_tokens: int) -> MicroBatch:
    """One image per sample, its tokens first, then the text; the loss on every text token
    (the synthetic and image-caption layout)."""
    b, t = text.shape
    filler = torch.zeros(b, image_tokens, dtype=text.dtype, device=text.device)
    tokens = torch.cat([filler, text], dim=1)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, image_tokens - 1 : image_tokens - 1 + t] = text
    mask = torch.zeros(b, image_tokens + t, dtype=torch.bool, device=text.device)
    mask[:, :image_tokens] = True
    return MicroBatch(images, tokens, labels, mask, image_tokens=image_tokens)


def collate(samples: list[MicroBatch]) -> MicroBatch:
    """One micro-batch from one-row micro-batches of equal sequence length (packed rows, or
    none packed)."""
    packed = [s.packed for s in samples]
    if any(packed) and not all(packed):
        raise ValueError("collate: packed and unpacked rows in one micro-batch")
    return MicroBatch(
        images=torch.cat([s.images for s in samples]),
        tokens=torch.cat([s.tokens for s in samples]),
        labels=torch.cat([s.labels for s in samples]),
        image_mask=torch.cat([s.image_mask for s in samples]),
        ids=tuple(i for s in samples for i in s.ids),
        truncated=sum(s.truncated for s in samples),
        no_answer=sum(s.no_answer for s in samples),
        image_tokens=samples[0].image_tokens,
        sources=tuple(i for s in samples for i in s.sources),
        positions=torch.cat([s.positions for s in samples]) if all(packed) else None,
        segments=torch.cat([s.segments for s in samples]) if all(packed) else None,
        **_native_of(samples),
    )


def _native_of(samples: list[MicroBatch]) -> dict:
    """The grids and merge of native-resolution samples, concatenated (else nothing)."""
    if not samples[0].native:
        return {}
    return {"grids": torch.cat([s.grids for s in samples]), "merge": samples[0].merge}


def pack(samples: list[MicroBatch], seq_length: int, pad: int) -> MicroBatch:
    """One row of `seq_length` from one-sample unpadded micro-batches (their lengths summing to
    at most `seq_length`), in order: each keeps its tokens, labels and images, its positions
    restart at 0, and the rest of the row is padding (`pad`, no label, its own segment -1)."""
    lengths = [s.tokens.shape[1] for s in samples]
    if sum(lengths) > seq_length:
        raise ValueError(f"pack: {sum(lengths)} tokens do not fit a row of {seq_length}")
    rest = seq_length - sum(lengths)
    first = samples[0]
    tokens = torch.cat([s.tokens for s in samples] + [first.tokens.new_full((1, rest), pad)], 1)
    labels = torch.cat(
        [s.labels for s in samples] + [first.labels.new_full((1, rest), IGNORE_INDEX)], 1
    )
    mask = torch.cat([s.image_mask for s in samples] + [first.image_mask.new_zeros(1, rest)], 1)
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(rest)]).unsqueeze(0)
    segments = torch.cat(
        [torch.full((n,), k) for k, n in enumerate(lengths)] + [torch.full((rest,), -1)]
    ).unsqueeze(0)
    return MicroBatch(
        images=torch.cat([s.images for s in samples]),
        tokens=tokens,
        labels=labels,
        image_mask=mask,
        ids=tuple(i for s in samples for i in s.ids),
        truncated=sum(s.truncated for s in samples),
        no_answer=sum(s.no_answer for s in samples),
        image_tokens=first.image_tokens,
        sources=tuple(i for s in samples for i in s.sources),
        positions=positions,
        segments=segments.to(torch.int32),
        **_native_of(samples),
    )
