"""The schedule IR's actions and their short, stable string forms.

    F:s1v0m3            backbone forward of pipeline stage 1, virtual chunk 0, micro-batch 3
    B:s1v0m3            backbone backward (with its weight gradients split off: the input
                        gradient only)
    W:s1v0m3            a split backbone backward's weight gradients
    EF:e0p1s0m3k0-12    encoder 0, encoder pipeline 1, encoder stage 0, micro-batch 3,
                        forward kernels [0, 12) of that stage
    EF:e0p1s0m3k4-7@tp2 the same, run inside TP bubble 2 of the next backbone action in the list
    EB:e0p1s0m3k0-12    encoder backward kernels [0, 12) (counted in backward order); with a
                        split backward only its input-gradient part
    EW:e0p1s0m3k0-4     a split backward's weight-gradient kernels [0, 4): they feed only the
                        encoder's gradient reduction, so they may run in any later bubble
    SEND:act.s1v0.m3    send a tensor, named by its key (see `keys`), to the rank that uses it
    RECV:act.s1v0.m3    wait for that tensor to arrive
    AG:bb  AG:e0        data-parallel all-gather of the backbone's (encoder 0's) parameters
    RS:bb  RS:e0        data-parallel reduce-scatter of their gradients

What the DP actions do today: the planner and simulator cost them as a distributed optimizer's
operations (AG: bf16 parameter all-gather, RS: fp32 gradient reduce-scatter). The runtime still
trains with a replicated fp32 optimizer, so there AG does nothing (parameters are already whole
on every DP rank) and RS is a full gradient all-reduce over the part's DP group. Making them
megatron-core's DistributedOptimizer operations is the bf16 / distributed-optimizer issue.

Micro-batch numbers are always the backbone's: the encoder pipeline that feeds backbone
micro-batch 3 calls its work m3 too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.keys import TensorKey, part_encoder

BACKBONE_KINDS = ("F", "B", "W")
ENCODER_KINDS = ("EF", "EB", "EW")
COMPUTE_KINDS = BACKBONE_KINDS + ENCODER_KINDS
TRANSFER_KINDS = ("SEND", "RECV")
DP_KINDS = ("AG", "RS")


@dataclass(frozen=True)
class Action:
    """One step of one rank's list. Unused fields keep their defaults."""

    kind: str
    stage: int = 0
    chunk: int = 0
    mb: int = 0
    enc: int = 0
    pipe: int = 0
    k0: int = 0
    k1: int = 0
    fill: int | None = None  # EF/EB only: index of the TP bubble of the next backbone action
    key: str = ""  # SEND/RECV: str(TensorKey); AG/RS: parameter part ("bb" or "e<N>")

    def __str__(self) -> str:
        if self.kind in BACKBONE_KINDS:
            return f"{self.kind}:s{self.stage}v{self.chunk}m{self.mb}"
        if self.kind in ENCODER_KINDS:
            fill = "" if self.fill is None else f"@tp{self.fill}"
            return (
                f"{self.kind}:e{self.enc}p{self.pipe}s{self.stage}m{self.mb}"
                f"k{self.k0}-{self.k1}{fill}"
            )
        return f"{self.kind}:{self.key}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


# Actions, cached: the constructors below go through it, so equal actions are mostly one object
# (a dictionary lookup then needs no field-by-field comparison).
_intern = lru_cache(maxsize=1 << 17)(Action)


def F(stage: int, mb: int, chunk: int = 0) -> Action:
    return _intern("F", stage, chunk, mb)


def B(stage: int, mb: int, chunk: int = 0) -> Action:
    return _intern("B", stage, chunk, mb)


def W(stage: int, mb: int, chunk: int = 0) -> Action:
    return _intern("W", stage, chunk, mb)


def EF(
    enc: int, pipe: int, stage: int, mb: int, k0: int, k1: int, fill: int | None = None
) -> Action:
    return _intern("EF", stage, 0, mb, enc, pipe, k0, k1, fill)


def EB(
    enc: int, pipe: int, stage: int, mb: int, k0: int, k1: int, fill: int | None = None
) -> Action:
    return _intern("EB", stage, 0, mb, enc, pipe, k0, k1, fill)


def EW(
    enc: int, pipe: int, stage: int, mb: int, k0: int, k1: int, fill: int | None = None
) -> Action:
    return _intern("EW", stage, 0, mb, enc, pipe, k0, k1, fill)


def SEND(key: str) -> Action:
    return _intern("SEND", 0, 0, 0, 0, 0, 0, 0, None, key)


def RECV(key: str) -> Action:
    return _intern("RECV", 0, 0, 0, 0, 0, 0, 0, None, key)


def AG(part: str) -> Action:
    return _intern("AG", 0, 0, 0, 0, 0, 0, 0, None, part)


def RS(part: str) -> Action:
    return _intern("RS", 0, 0, 0, 0, 0, 0, 0, None, part)


_BACKBONE_RE = re.compile(r"^(F|B|W):s(\d+)v(\d+)m(\d+)$")
_ENCODER_RE = re.compile(r"^(EF|EB|EW):e(\d+)p(\d+)s(\d+)m(\d+)k(\d+)-(\d+)(?:@tp(\d+))?$")
_KEY_RE = re.compile(r"^(SEND|RECV):(\S+)$")  # and the key parses (`TensorKey.parse`)
_DP_RE = re.compile(r"^(AG|RS):(\S+)$")  # and the part parses (`part_encoder`)


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`. Raises ConfigError naming the text and the expected forms."""
    s = text.strip()
    if m := _BACKBONE_RE.match(s):
        return Action(m[1], stage=int(m[2]), chunk=int(m[3]), mb=int(m[4]))
    if m := _ENCODER_RE.match(s):
        k0, k1 = int(m[6]), int(m[7])
        if k1 <= k0:
            raise ConfigError(f"action '{s}': empty kernel range k{k0}-{k1}; need k0 < k1")
        fill = None if m[8] is None else int(m[8])
        return Action(
            m[1],
            stage=int(m[4]),
            mb=int(m[5]),
            enc=int(m[2]),
            pipe=int(m[3]),
            k0=k0,
            k1=k1,
            fill=fill,
        )
    if (m := _KEY_RE.match(s)) or (m := _DP_RE.match(s)):
        try:
            if m[1] in TRANSFER_KINDS:
                TensorKey.parse(m[2])
            else:
                part_encoder(m[2])
        except ValueError as err:
            raise ConfigError(f"action '{s}': {err}") from None
        return Action(m[1], key=m[2])
    raise ConfigError(
        f"cannot parse action '{s}'; expected forms like F:s0v0m1, B:s0v0m1, W:s0v0m1, "
        "EF:e0p0s0m1k0-8, EB:e0p0s0m1k0-8@tp0, EW:e0p0s0m1k0-4, SEND:act.s1v0.m1, "
        "RECV:act.s1v0.m1, AG:bb, RS:e0"
    )
