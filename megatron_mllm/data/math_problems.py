"""Procedural math problems by topic (the `mathgenerator` package), made offline, as
("question=", "answer") text pairs: the tiny LLaVA digits set's text-only records and the
coreset benchmark's mixture sources."""

from __future__ import annotations

import random


def _clean(text: str) -> str:
    return (
        text.replace("$", "")
        .replace("\\cdot", "*")
        .replace("\\div", "/")
        .replace(" ", "")
        .replace("\\", "")
    )


def math_problems(topic: str, rng: random.Random, n: int) -> list[tuple[str, str]]:
    """`n` problems of `topic` (a mathgenerator function name), drawn from `rng`."""
    import mathgenerator

    gen = getattr(mathgenerator, topic)
    random.seed(rng.random())  # mathgenerator draws from the global RNG
    out = []
    for _ in range(n):
        q, a = gen()
        q, a = _clean(q), _clean(a)
        out.append((q if q.endswith("=") else q + "=", a))
    return out
