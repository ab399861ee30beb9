"""The tiny real multimodal data set, made offline: scikit-learn's handwritten digits as PNG and
JPEG files of varying size, in LLaVA-format conversations with zero, one or two images each.

Sources (each record's "source" field): "digit" (what digit is shown, one image), "compare"
(which of two images shows the larger digit, two images), "count" (how many digits a strip of
1-4 shows, one wide image), "math" (text-only arithmetic from mathgenerator).
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


def write_llava_digits(out: str | Path, n: int = 400, seed: int = 0) -> Path:
    """Write `n` records to OUT/llava.json and their images to OUT/images/; returns the JSON's
    path. Refuses a non-empty OUT (nothing is overwritten)."""
    from sklearn.datasets import load_digits

    from megatron_mllm.data.mixture import _math

    root = Path(out)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"{root} exists and is not an empty folder; give a new output folder")
    (root / "images").mkdir(parents=True)
    digits, rng = load_digits(), random.Random(seed)
    math = iter(_math("addition", rng, n))
    records = []
    for k in range(n):
        source, rid = SOURCES[k % len(SOURCES)], f"s{k:05d}"
        picks = [rng.randrange(len(digits.target)) for _ in range(rng.randint(1, 4))]
        sizes = [rng.choice((16, 24, 32, 48)) for _ in picks]
        ext = rng.choice(("png", "jpg"))
        shown = [_image(digits.images[i], s) for i, s in zip(picks, sizes, strict=True)]
        labels = [int(digits.target[i]) for i in picks]
        if source == "math":
            q, a = next(math)
            records.append(_record(rid, source, [], f"What is {q[:-1]}?", a))
            continue
        if source == "digit":
            files, question, answer = [shown[:1]], "What digit is shown?", str(labels[0])
        elif source == "compare":
            while len(shown) < 2:
                i = rng.randrange(len(digits.target))
                shown.append(_image(digits.images[i], 24))
                labels.append(int(digits.target[i]))
            files = [shown[:1], shown[1:2]]
            question = f"First {IMAGE} second {IMAGE}: which shows the larger digit?"
            answer = "first" if labels[0] >= labels[1] else "second"
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


def conversation_texts(json_path: str | Path) -> list[str]:
    """Every turn's text of a LLaVA JSON, placeholders removed (a tokenizer's training text)."""
    records = json.loads(Path(json_path).read_text())
    return [t["value"].replace(IMAGE, "") for r in records for t in r["conversations"]]
