"""Image-caption data on disk in the WebDataset layout, prepared for megatron-energon (the
Megatron ecosystem's multimodal loader): tar shards whose members are grouped by key, here
`<key>.npy` (a uint8 image) and `<key>.txt` (its caption), plus energon's `.nv-meta/` (shard
index, split, and a dataset.yaml mapping them onto energon's CaptioningSample), so
`megatron.energon.get_train_dataset(DIR, ...)` reads them as they are. `write_digit_shards`
makes the tiny default from scikit-learn's bundled handwritten digits; `ImageCaptionShards`
reads any such shards (energon-prepared or not) into memory, indexed, for bit-identical resume.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import torch

from megatron_mllm.errors import ConfigError

_WORDS = "zero one two three four five six seven eight nine".split()


ENERGON_DATASET_YAML = """\
sample_type:
  __module__: megatron.energon
  __class__: CaptioningSample
field_map:
  image: npy
  caption: txt
"""


def prepare_for_energon(shard_dir: str | Path) -> None:
    """Write energon's `.nv-meta/` for the shards in `shard_dir` (all in the train split)."""
    from megatron.energon.flavors.webdataset import BaseWebdatasetFactory

    root = Path(shard_dir)
    tars = sorted(p.name for p in root.glob("*.tar"))
    BaseWebdatasetFactory.prepare_dataset(
        root, tars, split_parts_ratio=[("train", 1.0)], workers=1, shuffle_seed=None
    )
    (root / ".nv-meta" / "dataset.yaml").write_text(ENERGON_DATASET_YAML)


def write_digit_shards(
    out_dir: str | Path, per_shard: int = 500, energon: bool = True
) -> list[Path]:
    """scikit-learn's 1797 digits (8x8) with captions like "a handwritten seven", as shards
    (prepared for energon unless `energon` is False)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, len(digits.target), per_shard):
        path = out / f"digits-{start // per_shard:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(start, min(start + per_shard, len(digits.target))):
                key = f"{i:06d}"
                image = (digits.images[i] * 16).clip(0, 255).astype(np.uint8)
                caption = f"a handwritten {_WORDS[int(digits.target[i])]}"
                for name, data in (
                    (f"{key}.npy", _npy_bytes(image)),
                    (f"{key}.txt", caption.encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    if energon:
        prepare_for_energon(out)
    return paths


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


class ImageCaptionShards:
    """All samples of the shards in `path` (a folder of .tar files), in memory."""

    def __init__(self, path: str | Path) -> None:
        shards = sorted(Path(path).glob("*.tar"))
        if not shards:
            raise ConfigError(
                f"--data-path {path}: no .tar shards there; make the tiny default "
                "(the coreset benchmark writes them with `write_digit_shards`)"
            )
        images, captions = {}, {}
        for shard in shards:
            with tarfile.open(shard) as tar:
                for member in tar.getmembers():
                    key, _, ext = member.name.rpartition(".")
                    data = tar.extractfile(member).read()
                    if ext == "npy":
                        images[(shard.name, key)] = np.load(io.BytesIO(data))
                    elif ext == "txt":
                        captions[(shard.name, key)] = data.decode()
        keys = sorted(set(images) & set(captions))
        if not keys:
            raise ConfigError(f"--data-path {path}: no sample has both .npy and .txt members")
        self.images = [images[k] for k in keys]
        self.captions = [captions[k] for k in keys]

    def __len__(self) -> int:
        return len(self.images)

    def batch(
        self, indices: list[int], image_size: int, channels: int, text_len: int, vocab_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Images resized (nearest) to [b, channels, image_size, image_size] in [-1, 1] and
        captions as character tokens padded with spaces to `text_len`."""
        imgs, texts = [], []
        for i in indices:
            img = torch.as_tensor(self.images[i % len(self)], dtype=torch.float32) / 127.5 - 1
            img = torch.nn.functional.interpolate(
                img[None, None], size=(image_size, image_size), mode="nearest"
            )[0]
            imgs.append(img.expand(channels, -1, -1))
            cap = self.captions[i % len(self)][:text_len].ljust(text_len)
            texts.append(torch.tensor([ord(c) % vocab_size for c in cap]))
        return torch.stack(imgs), torch.stack(texts)
