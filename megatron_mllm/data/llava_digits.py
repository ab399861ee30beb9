"""The tiny real multimodal data set, made offline: scikit-learn's handwritten digits as PNG and
JPEG files of varying size, in LLaVA-format conversations with zero, one or two images each.

Sources (each record's "source" field): "digit" (what digit is shown, one image), "compare"
(which of two images shows the larger digit, two images), "count" (how many digits a strip of
1-4 shows, one wide image), "math" (text-only arithmetic from mathgenerator), and with a
distribution of images per sample "largest" (which of three or more images shows the largest
digit).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from megatron_mllm.data.llava import IMAGE
from megatron_mllm.errors import ConfigError

SOURCES = ("digit", "compare", "count", "math")


def _image(pixels: np.ndarray, size: int):
    """An 8x8 digit (values 0-16) as a white-on-black RGB image of `size` pixels a side."""
    from PIL import Image

    gray = (pixels * (255 / 16)).astype(np.uint8)
    return Image.fromarray(gray).resize((size, size), Image.NEAREST).convert("RGB")


def _strip(images: list):
    """Images side by side (the count task's one wide image)."""
    from PIL import Image

    out = Image.new("RGB", (sum(i.width for i in images), max(i.height for i in images)))
    x = 0
    for img in images:
        out.paste(img, (x, 0))
        x += img.width
    return out


def _record(rid: str, source: str, images: list[str], question: str, answer: str) -> dict:
    record = {"id": rid, "source": source, "conversations": [
        {"from": "human", "value": question}, {"from": "gpt", "value": answer}]}  # fmt: skip
    if images:
        record["image"] = images[0] if len(images) == 1 else images
    return record


def _side(rng: random.Random, sizes: dict[int, float] | None) -> int:
    """An image's side in pixels: from `sizes` (side -> share), else 16, 24, 32 or 48."""
    if sizes is None:
        return rng.choice((16, 24, 32, 48))
    return rng.choices(list(sizes), weights=list(sizes.values()))[0]


def write_llava_digits(
    out: str | Path,
    n: int = 400,
    seed: int = 0,
    images: dict[int, float] | None = None,
    sizes: dict[int, float] | None = None,
) -> Path:
    """Write `n` records to OUT/llava.json and their images to OUT/images/; returns the JSON's
    path. Refuses a non-empty OUT (nothing is overwritten). `images` (images in a record ->
    share of records, `loads.parse_distribution`'s form): each record's image count is drawn
    from it (0: math, 1: digit, 2: compare, more: largest); without it the four sources take
    turns. `sizes` (side in pixels -> share of images): each image's size is drawn from it
    (for native-resolution towers: e.g. 16 to 160 pixels, 16 to 1600 patches of 4)."""
    from sklearn.datasets import load_digits

    from megatron_mllm.data.math_problems import math_problems

    root = Path(out)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"{root} exists and is not an empty folder; give a new output folder")
    (root / "images").mkdir(parents=True)
    digits, rng = load_digits(), random.Random(seed)
    math = iter(math_problems("addition", rng, n))
    records = []
    draw = _SourceDraw(images, rng)
    extra = 24 if sizes is None else None  # more digits' side (None: each drawn from `sizes`)
    for k in range(n):
        source, rid = draw(k), f"s{k:05d}"
        picks = [rng.randrange(len(digits.target)) for _ in range(rng.randint(1, 4))]
        sides = [_side(rng, sizes) for _ in picks]
        ext = rng.choice(("png", "jpg"))
        shown = [_image(digits.images[i], s) for i, s in zip(picks, sides, strict=True)]
        labels = [int(digits.target[i]) for i in picks]
        if source == "math":
            q, a = next(math)
            records.append(_record(rid, source, [], f"What is {q[:-1]}?", a))
            continue
        if source == "digit":
            files, question, answer = [shown[:1]], "What digit is shown?", str(labels[0])
        elif source == "compare":
            shown, labels = _more_digits(shown[:2], labels[:2], 2, digits, rng, extra, sizes)
            files = [shown[:1], shown[1:2]]
            question = f"First {IMAGE} second {IMAGE}: which shows the larger digit?"
            answer = "first" if labels[0] >= labels[1] else "second"
        elif source == "largest":
            shown, labels = _more_digits(shown, labels, draw.count, digits, rng, extra, sizes)
            files = [[img] for img in shown]
            question = f"Which of these {len(shown)} images shows the largest digit? " + " ".join(
                [IMAGE] * len(shown)
            )
            answer = str(labels.index(max(labels)) + 1)
        else:
            files, question, answer = (
                [shown],
                "How many digits does this strip show?",
                str(len(shown)),
            )
        names = []
        for j, group in enumerate(files):
            name = f"{rid}_{j}.{ext}"
            (_strip(group) if len(group) > 1 else group[0]).save(root / "images" / name)
            names.append(name)
        records.append(_record(rid, source, names, question, answer))
    path = root / "llava.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def _more_digits(
    shown: list, labels: list[int], count: int, digits, rng, side: int | None = 24, sizes=None
) -> tuple[list, list]:
    """`count` images and their digits: the first of `shown`, then random ones of `side`
    pixels (None: each of a side drawn from `sizes`)."""
    shown, labels = shown[:count], labels[:count]
    while len(shown) < count:
        i = rng.randrange(len(digits.target))
        shown.append(_image(digits.images[i], side or _side(rng, sizes)))
        labels.append(int(digits.target[i]))
    return shown, labels


class _SourceDraw:
    """Record k's source: the four in turn, or by an image count drawn from a distribution
    (`count` then holds the last count drawn)."""

    def __init__(self, images: dict[int, float] | None, rng: random.Random) -> None:
        self.images, self.rng, self.count = images, rng, 0
        if images is not None and (not images or any(c < 0 for c in images)):
            raise ConfigError(f"images per sample {images}: give counts >= 0 with their shares")

    def __call__(self, k: int) -> str:
        if self.images is None:
            return SOURCES[k % len(SOURCES)]
        counts, shares = zip(*sorted(self.images.items()), strict=True)
        self.count = self.rng.choices(counts, weights=shares)[0]
        return {0: "math", 1: "digit", 2: "compare"}.get(self.count, "largest")


def conversation_texts(json_path: str | Path) -> list[str]:
    """Every turn's text of a LLaVA JSON, placeholders removed (a tokenizer's training text)."""
    records = json.loads(Path(json_path).read_text())
    return [t["value"].replace(IMAGE, "") for r in records for t in r["conversations"]]
