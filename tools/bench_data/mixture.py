"""Multi-source text mixtures made here, offline, imbalanced the way real mixtures are, with a
held-out split per source. Character-level tokens; each example is "question=answer" and the
loss is on the answer.

* `SKEWED_SOURCES` (the coreset benchmark's default): one large source of additions, two
  thirds from a table of 16 easy sums (learned early) and a third from 200 harder ones, and
  seven small fact or rule sources (subtraction, multiplication table, maximum, next and
  previous letter, remainder, doubling), sizes spread 31x (0.62 down to 0.02), all learnable by
  a tiny model in minutes.
* `DEFAULT_SOURCES`: procedural math problems by topic (the `mathgenerator` package) and
  captions of scikit-learn's handwritten digits (harder; a tiny model barely learns them)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from megatron_mllm.data.math_problems import math_problems
from megatron_mllm.errors import ConfigError

# name -> share of the training pool (a few big, several small)
DEFAULT_SOURCES = {
    "addition": 0.30,
    "multiplication": 0.22,
    "subtraction": 0.16,
    "digits": 0.12,
    "division": 0.06,
    "square": 0.05,
    "factorial": 0.05,
    "binary_to_decimal": 0.04,
}
# name -> share: one big source, seven small ones (CoLM's setting: small sources that random
# batches under-represent)
SKEWED_SOURCES = {
    "add": 0.62,
    "sub": 0.10,
    "mul": 0.08,
    "max": 0.06,
    "next": 0.05,
    "prev": 0.04,
    "mod3": 0.03,
    "double": 0.02,
}
VOCAB = sorted(set("0123456789+-*/=!^ abcdefghijklmnopqrstuvwxyz.,:") | {"#", "?"})
PAD, UNK = "#", "?"
_DIGIT_WORDS = "zero one two three four five six seven eight nine".split()


def _digit_captions(rng: random.Random, n: int) -> list[tuple[str, str]]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    out = []
    for _ in range(n):
        i = rng.randrange(len(digits.target))
        rows = digits.images[i].sum(axis=1)
        ink = "".join(str(min(9, int(r) // 8)) for r in rows)  # 8 row-ink levels, one digit each
        out.append((f"ink{ink}=", _DIGIT_WORDS[int(digits.target[i])]))
    return out


def _letters(rng: random.Random, k: int, alphabet: str = "abcdefghijklmnopqrstuvwxyz") -> str:
    return "".join(rng.choice(alphabet) for _ in range(k))


def _add(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 1 / 3:  # a third from a table of 200 sums (hard)
        a, b = rng.randint(0, 19), rng.randint(0, 9)
    else:  # the rest from 16 (easy, learned early)
        a, b = rng.randint(0, 3), rng.randint(0, 3)
    return f"{a}+{b}=", str(a + b)


def _sub(rng: random.Random) -> tuple[str, str]:
    a, b = sorted((rng.randint(0, 9), rng.randint(0, 9)), reverse=True)
    return f"{a}-{b}=", str(a - b)


def _mul(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a}*{b}=", str(a * b)


def _max(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"max {a}{b}=", str(max(a, b))


def _next(rng: random.Random) -> tuple[str, str]:
    c = _letters(rng, 1, "abcdefghijklmnopqrstuvwxy")
    return f"next {c}=", chr(ord(c) + 1)


def _prev(rng: random.Random) -> tuple[str, str]:
    c = _letters(rng, 1, "bcdefghijklmnopqrstuvwxyz")
    return f"prev {c}=", chr(ord(c) - 1)


def _mod3(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 29)
    return f"{n} mod 3=", str(n % 3)


def _double(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 49)
    return f"2*{n}=", str(2 * n)


_RULES = {f.__name__[1:]: f for f in (_add, _sub, _mul, _max, _next, _prev, _mod3, _double)}


def _examples(name: str, rng: random.Random, n: int) -> list[tuple[str, str]]:
    """`n` (question, answer) pairs of source `name`: a rule above, digit captions, or a
    mathgenerator topic."""
    if name in _RULES:
        return [_RULES[name](rng) for _ in range(n)]
    if name == "digits":
        return _digit_captions(rng, n)
    return math_problems(name, rng, n)


@dataclass
class Mixture:
    """Tokenised examples: `tokens` [n, seq_len], `answer_mask` [n, seq_len] (positions whose
    next token is part of the answer), `source` [n], and the source names."""

    tokens: torch.Tensor
    answer_mask: torch.Tensor
    source: torch.Tensor
    names: list[str]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def subset(self, idx: torch.Tensor) -> Mixture:
        return Mixture(self.tokens[idx], self.answer_mask[idx], self.source[idx], self.names)


def encode(pairs: list[tuple[str, str]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = {c: i for i, c in enumerate(VOCAB)}
    toks = torch.full((len(pairs), seq_len), index[PAD], dtype=torch.long)
    mask = torch.zeros((len(pairs), seq_len), dtype=torch.bool)
    for row, (q, a) in enumerate(pairs):
        text = (q + a)[:seq_len]
        ids = [index.get(c, index[UNK]) for c in text.lower()]
        toks[row, : len(ids)] = torch.tensor(ids)
        start, end = min(len(q), seq_len) - 1, len(ids) - 1  # predict answer chars
        mask[row, start:end] = True
    return toks, mask


def build_mixture(
    total: int,
    seed: int = 0,
    seq_len: int = 32,
    sources: dict[str, float] | None = None,
    heldout_per_source: int = 64,
) -> tuple[Mixture, Mixture]:
    """(train, held-out): `total` training examples split by share, plus a held-out set with
    the same number of examples from every source."""
    sources = sources or DEFAULT_SOURCES
    for name, share in sources.items():
        if share <= 0 or int(round(share * total)) == 0:
            raise ConfigError(
                f"source '{name}' would be empty ({share} of {total} examples); "
                "give every source a positive share of at least one example"
            )
    rng = random.Random(seed)
    train_pairs, train_src, held_pairs, held_src = [], [], [], []
    for s, (name, share) in enumerate(sources.items()):
        n = int(round(share * total))
        pairs = _examples(name, rng, n + heldout_per_source)
        train_pairs += pairs[:n]
        train_src += [s] * n
        held_pairs += pairs[n:]
        held_src += [s] * heldout_per_source
    names = list(sources)
    tt, tm = encode(train_pairs, seq_len)
    ht, hm = encode(held_pairs, seq_len)
    return (
        Mixture(tt, tm, torch.tensor(train_src), names),
        Mixture(ht, hm, torch.tensor(held_src), names),
    )
