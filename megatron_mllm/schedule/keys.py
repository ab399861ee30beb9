"""One vocabulary for tensor keys: the names of the tensors and events that flow between actions.

    act.s{S}v{V}.m{M}        input activation of backbone virtual stage (S, V)       (sent)
    grad.s{S}v{V}.m{M}       gradient of the output of backbone virtual stage (S, V) (sent)
    eout.e{E}.m{M}           encoder E's (projected) output for backbone micro-batch M (sent)
    egrad.e{E}.m{M}          gradient of that output, made by backbone stage 0's backward (sent)
    eact.e{E}.s{S}.m{M}      input activation of encoder stage S                     (sent)
    egin.e{E}.s{S}.m{M}      gradient of the output of encoder stage S               (sent)
    fwd.s{S}v{V}.m{M}        backbone forward done (stays on its rank, as do those below)
    bwd.s{S}v{V}.m{M}        backbone backward done
    wgt.s{S}v{V}.m{M}        a split backbone backward's weight gradients done
    ek.e{E}.s{S}.m{M}.k{K}   encoder forward done up to kernel K
    ebk.e{E}.s{S}.m{M}.k{K}  encoder backward done up to kernel K (in backward order)
    ewk.e{E}.s{S}.m{M}.k{K}  encoder weight gradients done up to kernel K (split backward)
    ebdone.e{E}.s{S}.m{M}    encoder stage backward done (with a split one: its weight part)
    params.bb  params.e{E}   a parameter part gathered: the backbone's, encoder E's

`TensorKey` builds keys (`TensorKey.act(stage, chunk, mb)`, ...) and parses them
(`TensorKey.parse`); `str(key)` is the string form above, which is what the IR stores.

Strings at the IR boundary: `Action.key` (loaded from and saved to CSV, also the parameter part of
AG/RS), `Op.key`, `Dataflow.needs/makes` and the executor's tensor table all hold the string form,
and TensorKey is used only to build and to take apart. The string is the tensor's identity
everywhere a key is stored or compared (sets of available keys, the dict of tensors on a GPU,
the crc32 message tag of `program.Op.tag`, traces, error messages), and mixing the two forms in
one set or dict would make equal keys compare unequal; strings are also what the CSV holds.
Numbers are canonical (no leading zeros), so `str(TensorKey.parse(s)) == s` for every key.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from functools import lru_cache

# Key kinds whose tensors cross ranks (moved by SEND/RECV, or between GPUs of one rank).
TRANSFER_KEY_KINDS = ("act", "grad", "eout", "egrad", "eact", "egin")

# kind -> which fields it has: "sv" stage, chunk, mb; "e" enc, mb; "es" enc, stage, mb;
# "esk" enc, stage, mb, k; "p" parameter part (enc, None for the backbone).
_SHAPES = {
    "act": "sv",
    "grad": "sv",
    "fwd": "sv",
    "bwd": "sv",
    "wgt": "sv",
    "eout": "e",
    "egrad": "e",
    "eact": "es",
    "egin": "es",
    "ebdone": "es",
    "ek": "esk",
    "ebk": "esk",
    "ewk": "esk",
    "params": "p",
}
_FIELDS = {
    "sv": ("stage", "chunk", "mb"),
    "e": ("enc", "mb"),
    "es": ("enc", "stage", "mb"),
    "esk": ("enc", "stage", "mb", "k"),
    "p": ("enc",),
}
_ALL = ("enc", "stage", "chunk", "mb", "k")
# kind -> (fields that must be ints >= 0, fields that must be None); params' enc is either.
_CHECK = {
    kind: (
        () if shape == "p" else _FIELDS[shape],
        tuple(f for f in _ALL if f not in _FIELDS[shape]),
    )
    for kind, shape in _SHAPES.items()
}
_N = r"(0|[1-9]\d*)"  # canonical: no leading zeros, so parse and str are inverses
_BODY = {
    "sv": re.compile(rf"s{_N}v{_N}\.m{_N}"),
    "e": re.compile(rf"e{_N}\.m{_N}"),
    "es": re.compile(rf"e{_N}\.s{_N}\.m{_N}"),
    "esk": re.compile(rf"e{_N}\.s{_N}\.m{_N}\.k{_N}"),
}
_PART = re.compile(rf"bb|e{_N}")
_FORMS = "act.s1v0.m3, eout.e0.m3, eact.e0.s1.m3, ek.e0.s1.m3.k4, params.bb, params.e0"


def part_name(enc: int | None) -> str:
    """A parameter part's name (AG/RS key): "bb" for the backbone, "e{enc}" for an encoder."""
    return "bb" if enc is None else f"e{enc}"


def part_encoder(part: str) -> int | None:
    """Inverse of `part_name`: None for "bb", E for "e{E}". Raises ValueError naming `part`."""
    m = _PART.fullmatch(part)
    if m is None:
        raise ValueError(f"not a parameter part: {part!r} (expected bb or e<N>, like e0)")
    return None if m[1] is None else int(m[1])


@dataclass(frozen=True, slots=True)
class TensorKey:
    """A parsed key. Fields a kind does not have are None (see the module docstring)."""

    kind: str
    enc: int | None = None
    stage: int | None = None
    chunk: int | None = None
    mb: int | None = None
    k: int | None = None
    _text: str = field(init=False, repr=False, compare=False)  # str(self), made once

    def __post_init__(self) -> None:
        check = _CHECK.get(self.kind)
        if check is None:
            raise ValueError(f"unknown tensor key kind {self.kind!r}; known: {', '.join(_SHAPES)}")
        numbers, absent = check
        for name in numbers:
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                self._set_number(name, value)
        for name in absent:
            if getattr(self, name) is not None:
                raise ValueError(f"a {self.kind} key has no {name} (got {getattr(self, name)!r})")
        if self.kind == "params" and self.enc is not None:
            self._set_number("enc", self.enc)
        object.__setattr__(self, "_text", self._format())

    def _set_number(self, name: str, value: object) -> None:
        """Store `value` as a plain int (a numpy integer, say), or raise ValueError."""
        try:
            number = operator.index(value)
        except TypeError:
            number = -1
        if number < 0 or isinstance(value, bool):
            raise ValueError(f"{self.kind} key: {name} must be an int >= 0, not {value!r}")
        object.__setattr__(self, name, number)

    # -- constructors, one per kind (cached, as `parse` is: keys are built very often) ------
    @staticmethod
    def act(stage: int, chunk: int, mb: int) -> TensorKey:
        return _intern("act", None, stage, chunk, mb, None)

    @staticmethod
    def grad(stage: int, chunk: int, mb: int) -> TensorKey:
        return _intern("grad", None, stage, chunk, mb, None)

    @staticmethod
    def fwd(stage: int, chunk: int, mb: int) -> TensorKey:
        return _intern("fwd", None, stage, chunk, mb, None)

    @staticmethod
    def bwd(stage: int, chunk: int, mb: int) -> TensorKey:
        return _intern("bwd", None, stage, chunk, mb, None)

    @staticmethod
    def wgt(stage: int, chunk: int, mb: int) -> TensorKey:
        return _intern("wgt", None, stage, chunk, mb, None)

    @staticmethod
    def eout(enc: int, mb: int) -> TensorKey:
        return _intern("eout", enc, None, None, mb, None)

    @staticmethod
    def egrad(enc: int, mb: int) -> TensorKey:
        return _intern("egrad", enc, None, None, mb, None)

    @staticmethod
    def eact(enc: int, stage: int, mb: int) -> TensorKey:
        return _intern("eact", enc, stage, None, mb, None)

    @staticmethod
    def egin(enc: int, stage: int, mb: int) -> TensorKey:
        return _intern("egin", enc, stage, None, mb, None)

    @staticmethod
    def ebdone(enc: int, stage: int, mb: int) -> TensorKey:
        return _intern("ebdone", enc, stage, None, mb, None)

    @staticmethod
    def ek(enc: int, stage: int, mb: int, k: int) -> TensorKey:
        return _intern("ek", enc, stage, None, mb, k)

    @staticmethod
    def ebk(enc: int, stage: int, mb: int, k: int) -> TensorKey:
        return _intern("ebk", enc, stage, None, mb, k)

    @staticmethod
    def ewk(enc: int, stage: int, mb: int, k: int) -> TensorKey:
        return _intern("ewk", enc, stage, None, mb, k)

    @staticmethod
    def params(enc: int | None = None) -> TensorKey:
        """Parameters of the backbone (enc None: "params.bb") or of encoder `enc`."""
        return _intern("params", enc, None, None, None, None)

    @staticmethod
    def params_of(part: str) -> TensorKey:
        """Parameters of an AG/RS part ("bb" or "e{E}")."""
        return _intern("params", part_encoder(part), None, None, None, None)

    # -- string form -----------------------------------------------------------------------
    def __str__(self) -> str:
        return self._text

    def _format(self) -> str:
        shape = _SHAPES[self.kind]
        if shape == "sv":
            return f"{self.kind}.s{self.stage}v{self.chunk}.m{self.mb}"
        if shape == "e":
            return f"{self.kind}.e{self.enc}.m{self.mb}"
        if shape == "es":
            return f"{self.kind}.e{self.enc}.s{self.stage}.m{self.mb}"
        if shape == "esk":
            return f"{self.kind}.e{self.enc}.s{self.stage}.m{self.mb}.k{self.k}"
        return f"params.{part_name(self.enc)}"

    @staticmethod
    def parse(s: str) -> TensorKey:
        """Inverse of `str(key)`. Raises ValueError naming `s`."""
        if not isinstance(s, str):
            raise ValueError(f"not a tensor key: {s!r} (not a string)")
        return _parse(s)

    @staticmethod
    def try_parse(s: str) -> TensorKey | None:
        """`parse(s)`, or None where `s` is not a key."""
        try:
            return TensorKey.parse(s)
        except ValueError:
            return None

    # -- derived -----------------------------------------------------------------------------
    @property
    def is_transfer(self) -> bool:
        """Whether the tensor crosses ranks (or GPUs of a rank): one of TRANSFER_KEY_KINDS."""
        return self.kind in TRANSFER_KEY_KINDS

    @property
    def part(self) -> str:
        """A params key's part ("bb" or "e{E}"), as AG/RS name it."""
        if self.kind != "params":
            raise ValueError(f"{self} is not a params key")
        return part_name(self.enc)

    @property
    def cost_name(self) -> str:
        """What `Workload.transfer_s` files the key's transfer time under (see `cost_name`)."""
        return cost_name(self.kind, self.enc)


def cost_name(kind: str, enc: int | None = None) -> str:
    """The name of a transfer cost: "act", "grad"; "eout.e0", "egin.e1", ... for the encoder
    transfer kinds (the other kinds are filed under the kind alone)."""
    return f"{kind}.e{enc}" if enc is not None and kind in TRANSFER_KEY_KINDS else kind


@lru_cache(maxsize=1 << 16)
def _parse(s: str) -> TensorKey:
    kind, dot, body = s.partition(".")
    shape = _SHAPES.get(kind)
    if not dot or shape is None:
        raise ValueError(f"not a tensor key: {s!r} (expected forms like {_FORMS})")
    if shape == "p":
        m = _PART.fullmatch(body)
        if m is None:
            raise ValueError(f"not a tensor key: {s!r} (expected params.bb or params.e<N>)")
        return TensorKey.params(None if m[1] is None else int(m[1]))
    m = _BODY[shape].fullmatch(body)
    if m is None:
        raise ValueError(f"not a tensor key: {s!r} ({kind} keys look like {_EXAMPLE[kind]})")
    values = dict(zip(_FIELDS[shape], map(int, m.groups()), strict=True))
    return _intern(kind, *(values.get(f) for f in _ALL))


# TensorKey(kind, enc, stage, chunk, mb, k), cached: the constructors and `parse` go through it.
_intern = lru_cache(maxsize=1 << 16)(TensorKey)

_EXAMPLE = {
    kind: TensorKey(kind, **{f: i + 1 for i, f in enumerate(_FIELDS[shape])})
    for kind, shape in _SHAPES.items()
    if shape != "p"
}
