"""What each action needs and makes: the one source of dependencies for validator and simulator.

Keys name tensors or events. Keys that cross ranks (sent by SEND, received by RECV):

    act.s{S}v{V}.m{M}    input activation of backbone virtual stage (S, V)
    grad.s{S}v{V}.m{M}   gradient of the output of backbone virtual stage (S, V)
    eout.e{E}.m{M}       encoder E's (projected) output for backbone micro-batch M
    egrad.e{E}.m{M}      gradient of that output, made by backbone stage 0's backward
    eact.e{E}.s{S}.m{M}  input activation of encoder stage S
    egin.e{E}.s{S}.m{M}  gradient of the output of encoder stage S

Keys that stay on a rank: params.<part>, fwd.s{S}v{V}.m{M}, bwd.s{S}v{V}.m{M},
ek.e{E}.s{S}.m{M}.k{K} (forward done up to kernel K), ebk... (backward), ebdone.e{E}.s{S}.m{M}.
"""

from __future__ import annotations

import re

from megatron_mllm.schedule.actions import Action
from megatron_mllm.schedule.schedule import ScheduleMeta

# The dependency rule a key stands for, named in validator errors.
RULES = {
    "act": "backbone forward needs its input activation from the previous stage",
    "grad": "backbone backward needs the gradient from the next stage",
    "fwd": "backbone backward runs after its own forward",
    "eout": "encoder output of the micro-batch must arrive before backbone stage 0 starts it",
    "egrad": "encoder backward of the micro-batch runs after its gradient arrives",
    "eact": "encoder stage needs its input from the previous encoder stage",
    "egin": "encoder backward needs the gradient from the next encoder stage",
    "ek": "encoder kernels run in order (backward after the stage's whole forward)",
    "ebk": "encoder backward kernels run in order",
    "params": "parameters are all-gathered before first use",
    "bwd": "gradients are reduce-scattered after every backward on the rank",
    "ebdone": "encoder gradients are reduce-scattered after every encoder backward on the rank",
}

TRANSFER_PREFIXES = ("act", "grad", "eout", "egrad", "eact", "egin")
_KEY_RE = re.compile(
    r"^(act|grad)\.s(\d+)v(\d+)\.m(\d+)$|^(eout|egrad)\.e(\d+)\.m(\d+)$"
    r"|^(eact|egin)\.e(\d+)\.s(\d+)\.m(\d+)$"
)


def key_prefix(key: str) -> str:
    return key.split(".", 1)[0]


def _sv(stage: int, chunk: int) -> str:
    return f"s{stage}v{chunk}"


class Dataflow:
    """Needs, makes and the owning ranks of keys, for one schedule's metadata and assignment."""

    def __init__(self, meta: ScheduleMeta, assignment: list[dict[int, int]]) -> None:
        self.meta = meta
        self.assignment = assignment
        self._needs: dict[Action, list[str]] = {}
        self._makes: dict[Action, list[str]] = {}
        self._ranks: dict[str, tuple[int | None, int | None]] = {}

    def needs(self, a: Action) -> list[str]:
        """Keys `a` waits for (on its own rank). Cached: do not modify the list."""
        out = self._needs.get(a)
        if out is None:
            out = self._needs[a] = self._compute_needs(a)
        return out

    def makes(self, a: Action) -> list[str]:
        """Keys available on `a`'s rank once it completes. Cached: do not modify the list."""
        out = self._makes.get(a)
        if out is None:
            out = self._makes[a] = self._compute_makes(a)
        return out

    def transfer_ranks(self, key: str) -> tuple[int | None, int | None]:
        """(producer rank, consumer rank) of a cross-rank key; None where unknown."""
        out = self._ranks.get(key)
        if out is None:
            out = self._ranks[key] = self._compute_transfer_ranks(key)
        return out

    # -- compute and communication actions ---------------------------------------------------
    def _compute_needs(self, a: Action) -> list[str]:
        meta = self.meta
        if a.kind == "F":
            v = meta.virtual_index(a.stage, a.chunk)
            if v > 0:
                return ["params.bb", f"act.{_sv(a.stage, a.chunk)}.m{a.mb}"]
            return ["params.bb"] + [f"eout.e{e}.m{a.mb}" for e in range(len(meta.encoders))]
        if a.kind == "B":
            need = [f"fwd.{_sv(a.stage, a.chunk)}.m{a.mb}"]
            if meta.virtual_index(a.stage, a.chunk) < meta.num_virtual_stages - 1:
                need.append(f"grad.{_sv(a.stage, a.chunk)}.m{a.mb}")
            return need
        if a.kind == "EF":
            need = [f"params.e{a.enc}"]
            if a.k0 > 0:
                need.append(f"ek.e{a.enc}.s{a.stage}.m{a.mb}.k{a.k0}")
            elif a.stage > 0:
                need.append(f"eact.e{a.enc}.s{a.stage}.m{a.mb}")
            return need
        if a.kind == "EB":
            enc = self.meta.encoders[a.enc]
            need = [f"ek.e{a.enc}.s{a.stage}.m{a.mb}.k{enc.fwd_kernels[a.stage]}"]
            if a.k0 > 0:
                need.append(f"ebk.e{a.enc}.s{a.stage}.m{a.mb}.k{a.k0}")
            elif a.stage == enc.num_stages - 1:
                need.append(f"egrad.e{a.enc}.m{a.mb}")
            else:
                need.append(f"egin.e{a.enc}.s{a.stage}.m{a.mb}")
            return need
        if a.kind == "SEND":
            return [a.key]
        return []  # RECV, AG; RS needs are rank-wide, see `rs_needs`

    def _compute_makes(self, a: Action) -> list[str]:
        meta = self.meta
        if a.kind == "F":
            v = meta.virtual_index(a.stage, a.chunk)
            out = [f"fwd.{_sv(a.stage, a.chunk)}.m{a.mb}"]
            if v < meta.num_virtual_stages - 1:
                out.append(f"act.{_sv(*meta.stage_chunk(v + 1))}.m{a.mb}")
            return out
        if a.kind == "B":
            v = meta.virtual_index(a.stage, a.chunk)
            out = [f"bwd.{_sv(a.stage, a.chunk)}.m{a.mb}"]
            if v > 0:
                out.append(f"grad.{_sv(*meta.stage_chunk(v - 1))}.m{a.mb}")
            else:
                out += [
                    f"egrad.e{e}.m{a.mb}" for e, enc in enumerate(meta.encoders) if enc.trainable
                ]
            return out
        if a.kind == "EF":
            enc = meta.encoders[a.enc]
            out = [f"ek.e{a.enc}.s{a.stage}.m{a.mb}.k{a.k1}"]
            if a.k1 == enc.fwd_kernels[a.stage]:
                last = a.stage == enc.num_stages - 1
                out.append(
                    f"eout.e{a.enc}.m{a.mb}" if last else f"eact.e{a.enc}.s{a.stage + 1}.m{a.mb}"
                )
            return out
        if a.kind == "EB":
            enc = meta.encoders[a.enc]
            out = [f"ebk.e{a.enc}.s{a.stage}.m{a.mb}.k{a.k1}"]
            if a.k1 == enc.bwd_kernels[a.stage]:
                out.append(f"ebdone.e{a.enc}.s{a.stage}.m{a.mb}")
                if a.stage > 0 and enc.bwd_kernels[a.stage - 1] > 0:
                    out.append(f"egin.e{a.enc}.s{a.stage - 1}.m{a.mb}")
            return out
        if a.kind == "RECV":
            return [a.key]
        if a.kind == "AG":
            return [f"params.{a.key}"]
        return []

    def rs_needs(self, rank: int, actions: list[Action], part: str) -> list[str]:
        """A reduce-scatter waits for every backward of its part on this rank."""
        if part == "bb":
            return [f"bwd.{_sv(a.stage, a.chunk)}.m{a.mb}" for a in actions if a.kind == "B"]
        e = int(part[1:])
        enc = self.meta.encoders[e]
        return [
            f"ebdone.e{e}.s{a.stage}.m{a.mb}"
            for a in actions
            if a.kind == "EB" and a.enc == e and a.k1 == enc.bwd_kernels[a.stage]
        ]

    # -- where things live ---------------------------------------------------------------------
    def encoder_rank(self, enc: int, mb: int, stage: int) -> int | None:
        pipe = self.assignment[enc].get(mb) if enc < len(self.assignment) else None
        if pipe is None:
            return None
        return self.meta.encoders[enc].placement[pipe][stage][0]

    def _compute_transfer_ranks(self, key: str) -> tuple[int | None, int | None]:
        m = _KEY_RE.match(key)
        if m is None:
            return None, None
        meta = self.meta
        if m[1]:
            stage, chunk, mb = int(m[2]), int(m[3]), int(m[4])
            v = meta.virtual_index(stage, chunk)
            if stage >= meta.pp or chunk >= meta.vpp or mb >= meta.num_microbatches:
                return None, None
            other = v - 1 if m[1] == "act" else v + 1
            if not 0 <= other < meta.num_virtual_stages:
                return None, None
            return meta.stage_chunk(other)[0], stage
        if m[5]:
            e, mb = int(m[6]), int(m[7])
            if e >= len(meta.encoders):
                return None, None
            last = self.encoder_rank(e, mb, meta.encoders[e].num_stages - 1)
            return (last, 0) if m[5] == "eout" else (0, last)
        e, stage, mb = int(m[9]), int(m[10]), int(m[11])
        if e >= len(meta.encoders) or stage >= meta.encoders[e].num_stages:
            return None, None
        other = stage - 1 if m[8] == "eact" else stage + 1
        if not 0 <= other < meta.encoders[e].num_stages:
            return None, None
        return self.encoder_rank(e, mb, other), self.encoder_rank(e, mb, stage)

    def home_rank(self, a: Action) -> int | None:
        """The rank an action must be on (None: it belongs nowhere)."""
        meta = self.meta
        if a.kind in ("F", "B"):
            ok = a.stage < meta.pp and a.chunk < meta.vpp and a.mb < meta.num_microbatches
            return a.stage if ok else None
        if a.kind in ("EF", "EB"):
            if a.enc >= len(meta.encoders) or a.mb >= meta.num_microbatches:
                return None
            enc = meta.encoders[a.enc]
            if a.pipe >= enc.num_pipes or a.stage >= enc.num_stages:
                return None
            return enc.placement[a.pipe][a.stage][0]
        if a.kind in ("SEND", "RECV"):
            producer, consumer = self.transfer_ranks(a.key)
            return producer if a.kind == "SEND" else consumer
        return -1  # AG/RS: any rank

    def slot(self, a: Action) -> int | None:
        """The slot an encoder action runs in; None for actions that use the whole rank."""
        if a.kind in ("EF", "EB"):
            return self.meta.encoders[a.enc].placement[a.pipe][a.stage][1]
        return None
