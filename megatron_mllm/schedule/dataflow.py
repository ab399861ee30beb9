"""What each action needs and makes: the one source of dependencies for validator and simulator.

Keys name tensors or events; `keys` defines them (`TensorKey`) and lists their forms. Needs and
makes are key strings (`str(TensorKey)`), the form the IR stores (see `keys`).
"""

from __future__ import annotations

from megatron_mllm.schedule.actions import BACKBONE_KINDS, ENCODER_KINDS, Action
from megatron_mllm.schedule.keys import TensorKey, part_encoder
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
    "ewk": "encoder weight-gradient kernels run in order, after the stage's input gradient",
    "params": "parameters are all-gathered before first use",
    "bwd": "gradients are reduce-scattered after every backward on the rank (and a split "
    "backward's weight gradients after its input gradient)",
    "wgt": "gradients are reduce-scattered after every split backward's weight gradients",
    "ebdone": "encoder gradients are reduce-scattered after every encoder backward on the rank",
}

_BB = str(TensorKey.params())  # "params.bb"
_SHARED: dict[tuple, Dataflow] = {}  # the last few (meta, assignment) shapes' dataflows
_SHARED_MAX = 8


class Dataflow:
    """Needs, makes and the owning ranks of keys, for one schedule's metadata and assignment."""

    def __init__(self, meta: ScheduleMeta, assignment: list[dict[int, int]]) -> None:
        self.meta = meta
        self.assignment = assignment
        self._needs: dict[Action, list[str]] = {}
        self._makes: dict[Action, list[str]] = {}
        self._ranks: dict[str, tuple[int | None, int | None]] = {}
        self._groups: dict[tuple, tuple[list[str], list[str]]] = {}

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
                return [_BB, str(TensorKey.act(a.stage, a.chunk, a.mb))]
            if not meta.has_images(a.mb):
                return [_BB]
            return [_BB] + [str(TensorKey.eout(e, a.mb)) for e in range(len(meta.encoders))]
        if a.kind == "B":
            need = [str(TensorKey.fwd(a.stage, a.chunk, a.mb))]
            if meta.virtual_index(a.stage, a.chunk) < meta.num_virtual_stages - 1:
                need.append(str(TensorKey.grad(a.stage, a.chunk, a.mb)))
            return need
        if a.kind == "W":
            return [str(TensorKey.bwd(a.stage, a.chunk, a.mb))]
        if a.kind == "EF":
            need = [str(TensorKey.params(a.enc))]
            if a.k0 > 0:
                need.append(str(TensorKey.ek(a.enc, a.stage, a.mb, a.k0)))
            elif a.stage > 0:
                need.append(str(TensorKey.eact(a.enc, a.stage, a.mb)))
            return need
        if a.kind == "EB":
            enc = self.meta.encoders[a.enc]
            need = [str(TensorKey.ek(a.enc, a.stage, a.mb, enc.fwd_kernels[a.stage]))]
            if a.k0 > 0:
                need.append(str(TensorKey.ebk(a.enc, a.stage, a.mb, a.k0)))
            elif a.stage == enc.num_stages - 1:
                need.append(str(TensorKey.egrad(a.enc, a.mb)))
            else:
                need.append(str(TensorKey.egin(a.enc, a.stage, a.mb)))
            return need
        if a.kind == "EW":
            enc = self.meta.encoders[a.enc]
            need = [str(TensorKey.ebk(a.enc, a.stage, a.mb, enc.bwd_kernels[a.stage]))]
            if a.k0 > 0:
                need.append(str(TensorKey.ewk(a.enc, a.stage, a.mb, a.k0)))
            return need
        if a.kind == "SEND":
            return [a.key]
        return []  # RECV, AG; RS needs are rank-wide, see `rs_needs`

    def _compute_makes(self, a: Action) -> list[str]:
        meta = self.meta
        if a.kind == "F":
            v = meta.virtual_index(a.stage, a.chunk)
            out = [str(TensorKey.fwd(a.stage, a.chunk, a.mb))]
            if v < meta.num_virtual_stages - 1:
                out.append(str(TensorKey.act(*meta.stage_chunk(v + 1), a.mb)))
            return out
        if a.kind == "B":
            v = meta.virtual_index(a.stage, a.chunk)
            out = [str(TensorKey.bwd(a.stage, a.chunk, a.mb))]
            if v > 0:
                out.append(str(TensorKey.grad(*meta.stage_chunk(v - 1), a.mb)))
            elif meta.has_images(a.mb):
                out += [
                    str(TensorKey.egrad(e, a.mb))
                    for e, enc in enumerate(meta.encoders)
                    if enc.trainable
                ]
            return out
        if a.kind == "W":
            return [str(TensorKey.wgt(a.stage, a.chunk, a.mb))]
        if a.kind == "EF":
            enc = meta.encoders[a.enc]
            out = [str(TensorKey.ek(a.enc, a.stage, a.mb, a.k1))]
            if a.k1 == enc.fwd_kernels[a.stage]:
                last = a.stage == enc.num_stages - 1
                made = (
                    TensorKey.eout(a.enc, a.mb)
                    if last
                    else TensorKey.eact(a.enc, a.stage + 1, a.mb)
                )
                out.append(str(made))
            return out
        if a.kind == "EB":
            enc = meta.encoders[a.enc]
            out = [str(TensorKey.ebk(a.enc, a.stage, a.mb, a.k1))]
            if a.k1 == enc.bwd_kernels[a.stage]:
                if not enc.wgt(a.stage):
                    out.append(str(TensorKey.ebdone(a.enc, a.stage, a.mb)))
                if a.stage > 0 and enc.bwd_kernels[a.stage - 1] > 0:
                    out.append(str(TensorKey.egin(a.enc, a.stage - 1, a.mb)))
            return out
        if a.kind == "EW":
            enc = meta.encoders[a.enc]
            out = [str(TensorKey.ewk(a.enc, a.stage, a.mb, a.k1))]
            if a.k1 == enc.wgt(a.stage):
                out.append(str(TensorKey.ebdone(a.enc, a.stage, a.mb)))
            return out
        if a.kind == "RECV":
            return [a.key]
        if a.kind == "AG":
            try:
                return [str(TensorKey.params_of(a.key))]
            except ValueError:  # not a part: the validator names it
                return []
        return []

    def rs_needs(self, rank: int, actions: list[Action], part: str) -> list[str]:
        """A reduce-scatter waits for every backward of its part on this rank."""
        e = part_encoder(part)
        if e is None:
            done = {"B": TensorKey.bwd, "W": TensorKey.wgt}
            return [str(done[a.kind](a.stage, a.chunk, a.mb)) for a in actions if a.kind in done]
        enc = self.meta.encoders[e]
        return [
            str(TensorKey.ebdone(e, a.stage, a.mb))
            for a in actions
            if a.enc == e and is_stage_backward_end(enc, a)
        ]

    def group_transfers(self, rank: int, members: tuple[Action, ...]) -> tuple[list, list]:
        """The keys an execution group (an action and its TP-bubble fills) on `rank` must
        receive before it and send after it, in first-use order. Cached: do not modify."""
        cache_key = (rank, members)
        out = self._groups.get(cache_key)
        if out is None:
            made_here = {k for a in members for k in self.makes(a)}
            recvs = [
                k
                for a in members
                for k in self._crossing(self.needs(a), rank, True)
                if k not in made_here
            ]
            sends = [k for a in members for k in self._crossing(self.makes(a), rank, False)]
            out = self._groups[cache_key] = (list(dict.fromkeys(recvs)), list(dict.fromkeys(sends)))
        return out

    def _crossing(self, keys: list[str], rank: int, incoming: bool) -> list[str]:
        """The transfer keys among `keys` that reach (`incoming`) or leave `rank`."""
        out = []
        for k in keys:
            key = TensorKey.try_parse(k)
            if key is None or not key.is_transfer:
                continue
            producer, consumer = self.transfer_ranks(k)
            if producer != consumer and (consumer if incoming else producer) == rank:
                out.append(k)
        return out

    # -- where things live ---------------------------------------------------------------------
    def encoder_rank(self, enc: int, mb: int, stage: int) -> int | None:
        pipe = self.assignment[enc].get(mb) if enc < len(self.assignment) else None
        if pipe is None:
            return None
        return self.meta.encoders[enc].placement[pipe][stage][0]

    def _compute_transfer_ranks(self, key: str) -> tuple[int | None, int | None]:
        k = TensorKey.try_parse(key)
        if k is None or not k.is_transfer:
            return None, None
        meta = self.meta
        backward = k.kind in ("grad", "egrad", "egin")
        if k.mb >= (meta.num_microbatches if backward else meta.total_microbatches):
            return None, None  # look-ahead micro-batches send nothing backward
        if k.kind in ("act", "grad"):
            if k.stage >= meta.pp or k.chunk >= meta.vpp:
                return None, None
            v = meta.virtual_index(k.stage, k.chunk)
            other = v - 1 if k.kind == "act" else v + 1
            if not 0 <= other < meta.num_virtual_stages:
                return None, None
            return meta.stage_chunk(other)[0], k.stage
        if k.enc >= len(meta.encoders):
            return None, None
        enc = meta.encoders[k.enc]
        if k.kind in ("eout", "egrad"):
            last = self.encoder_rank(k.enc, k.mb, enc.num_stages - 1)
            return (last, 0) if k.kind == "eout" else (0, last)
        if k.stage >= enc.num_stages:
            return None, None
        other = k.stage - 1 if k.kind == "eact" else k.stage + 1
        if not 0 <= other < enc.num_stages:
            return None, None
        return self.encoder_rank(k.enc, k.mb, other), self.encoder_rank(k.enc, k.mb, k.stage)

    def home_rank(self, a: Action) -> int | None:
        """The rank an action must be on (None: it belongs nowhere)."""
        meta = self.meta
        if a.kind in BACKBONE_KINDS:
            ok = a.stage < meta.pp and a.chunk < meta.vpp and a.mb < meta.total_microbatches
            return a.stage if ok else None
        if a.kind in ENCODER_KINDS:
            if a.enc >= len(meta.encoders) or a.mb >= meta.total_microbatches:
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
        if a.kind in ENCODER_KINDS:
            return self.meta.encoders[a.enc].placement[a.pipe][a.stage][1]
        return None


def dataflow_of(meta: ScheduleMeta, assignment: list[dict[int, int]]) -> Dataflow:
    """The one Dataflow of a schedule shape: schedules with equal metadata and encoder
    assignment (a step's candidate plans, one schedule simulated at many loads) share its
    needs and makes, computed once."""
    key = (meta, tuple(tuple(sorted(pipes.items())) for pipes in assignment))
    flow = _SHARED.get(key)
    if flow is None:
        while len(_SHARED) >= _SHARED_MAX:
            _SHARED.pop(next(iter(_SHARED)), None)
        flow = _SHARED[key] = Dataflow(meta, assignment)
    return flow


def is_stage_backward_end(enc, a: Action) -> bool:
    """Whether `a` ends its encoder stage's backward for its micro-batch (the last EB kernel,
    or with a split backward the last EW kernel): its gradients are then complete."""
    if a.kind == "EW":
        return a.k1 == enc.wgt(a.stage)
    return a.kind == "EB" and a.k1 == enc.bwd_kernels[a.stage] and not enc.wgt(a.stage)
