"""From a schedule rank's list to one GPU's program: its own encoder slot's actions, and every
SEND/RECV turned into GPU-to-GPU messages (also inside a rank, where the encoder's output moves
from its slot's GPUs to the whole TP group)."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, replace

from megatron_mllm.parallel.groups import ColocatedGroups, RankCoords, backbone_rank, rank_coords
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.schedule.actions import Action
from megatron_mllm.schedule.dataflow import Dataflow
from megatron_mllm.schedule.keys import TensorKey
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.validator import backbone_groups


@dataclass(frozen=True)
class Op:
    """One step of a GPU's program: an IR action (compute, AG, RS) or a message."""

    kind: str  # "run", "send", "recv"
    action: Action | None = None
    key: str = ""  # str(TensorKey): names the message, and its tag
    peer: int = -1
    fills: tuple[Action, ...] = ()  # TP-bubble fills that travel with a backbone action

    @functools.cached_property
    def mb(self) -> int | None:
        """The micro-batch the op works on (None for AG / RS); its key is parsed once per op,
        not once per step."""
        if self.kind == "run":
            return None if self.action.kind in ("AG", "RS") else self.action.mb
        return TensorKey.parse(self.key).mb

    @property
    def tag(self) -> int:
        return zlib.crc32(self.key.encode()) & 0x7FFFFFF

    def __str__(self) -> str:
        if self.kind == "run":
            return str(self.action)
        arrow = "->" if self.kind == "send" else "<-"
        return f"{self.kind.upper()}:{self.key}{arrow}rank{self.peer}"


class Routes:
    """Which GPU sends each key to which GPU, inside one backbone replica."""

    def __init__(self, schedule: Schedule, groups: ColocatedGroups, encoder_tp: int) -> None:
        self.meta = schedule.meta
        self.flow = Dataflow(schedule.meta, schedule.encoder_assignment())
        self.bplan = groups.backbone_plan
        self.dp = groups.coords.dp
        self.enc_tp = encoder_tp

    def _rank(self, tp: int, stage: int) -> int:
        return backbone_rank(self.bplan, tp, self.dp, stage)

    def pairs(self, key: str) -> list[tuple[int, int]]:
        k = TensorKey.parse(key)
        if not k.is_transfer:
            raise ValueError(f"{key} stays on its GPU: it has no routes")
        src_lane, dst_lane = self.flow.transfer_ranks(key)
        tp = self.bplan.tp
        if k.kind in ("act", "grad"):
            return [(self._rank(t, src_lane), self._rank(t, dst_lane)) for t in range(tp)]
        enc = self.meta.encoders[k.enc]
        pipe = self.flow.assignment[k.enc][k.mb]
        if k.kind == "eout":
            slot = enc.placement[pipe][-1][1]
            return [
                (
                    self._rank(slot * self.enc_tp + t % self.enc_tp, src_lane),
                    self._rank(t, dst_lane),
                )
                for t in range(tp)
            ]
        slot = enc.placement[pipe][0][1]
        return [
            (
                self._rank(slot * self.enc_tp + t, src_lane),
                self._rank(slot * self.enc_tp + t, dst_lane),
            )
            for t in range(self.enc_tp)
        ]


def gpu_program(schedule: Schedule, groups: ColocatedGroups, encoder_tp: int) -> list[Op]:
    """This GPU's ordered ops (see module docstring)."""
    me = groups.coords.rank
    lane, slot = groups.coords.stage, groups.coords.enc_slot
    routes = Routes(schedule, groups, encoder_tp)
    flow = routes.flow
    acts = schedule.ranks[lane]
    ops: list[Op] = []

    def mine(a: Action) -> bool:
        return a.kind not in ("EF", "EB") or flow.slot(a) == slot

    def messages(key: str, incoming: bool) -> list[Op]:
        """This GPU's receives (or sends) of `key`: one per route that ends (starts) here."""
        return [
            Op("recv", key=key, peer=src) if incoming else Op("send", key=key, peer=dst)
            for src, dst in routes.pairs(key)
            if src != dst and (dst if incoming else src) == me
        ]

    def local_moves(keys: list[str], incoming: bool) -> list[Op]:
        """Encoder output/gradient moving between GPUs of this rank (no SEND/RECV in the IR)."""
        out = []
        for k in keys:
            kind = TensorKey.parse(k).kind
            if kind in ("eout", "egrad") and len(set(flow.transfer_ranks(k))) == 1:
                out += messages(k, incoming)
        return out

    for group in backbone_groups(acts):
        members = [acts[i] for i in group if mine(acts[i])]
        if not members:
            continue
        main = members[-1]
        if main.kind in ("SEND", "RECV"):
            ops += messages(main.key, incoming=main.kind == "RECV")
            continue
        for a in members:
            ops += local_moves(flow.needs(a), incoming=True)
        ops.append(Op("run", main, fills=tuple(members[:-1])))
        for a in members:
            ops += local_moves(flow.makes(a), incoming=False)
    return ops


@dataclass(frozen=True)
class _RankView:
    """What `gpu_program` reads of a rank's groups, without creating any process group."""

    coords: RankCoords
    backbone_plan: ParallelPlan


def all_programs(
    schedule: Schedule, backbone: ParallelPlan, encoder: ParallelPlan, encoder_tp: int
) -> dict[int, list[Op]]:
    """Every GPU's program, computed on one process (for checks; no group is created)."""
    return {
        r: gpu_program(schedule, _RankView(rank_coords(r, backbone, encoder), backbone), encoder_tp)
        for r in range(backbone.world_size)
    }


def receive_orders(programs: dict[int, list[Op]], rank: int) -> dict[int, list[str]]:
    """For `rank`: each sender's messages to it, in the order the sender posts them."""
    out: dict[int, list[str]] = {}
    for src, program in programs.items():
        for op in program:
            if op.kind == "send" and op.peer == rank:
                out.setdefault(src, []).append(op.key)
    return out


def message_pairs(*program_sets: dict[int, list[Op]]) -> list[tuple[int, int]]:
    """Every (sender, receiver) pair with a message, sorted (the same list on every rank)."""
    pairs = set()
    for programs in program_sets:
        for rank, program in programs.items():
            pairs |= {(rank, op.peer) for op in program if op.kind == "send"}
    return sorted(pairs)


def pairwise_order_problems(programs: dict[int, list[Op]]) -> list[str]:
    """Where a sender posts its messages to a receiver in another order than the receiver
    posts the matching receives. Gloo matches our messages by tag, but NCCL has no tags: it
    pairs each pair's sends and receives in posting order, so there any such reordering would
    hand a tensor to the wrong receive (silently, when the shapes agree)."""
    sent: dict[tuple[int, int], list[str]] = {}
    received: dict[tuple[int, int], list[str]] = {}
    for rank, program in programs.items():
        for op in program:
            if op.kind == "send":
                sent.setdefault((rank, op.peer), []).append(op.key)
            elif op.kind == "recv":
                received.setdefault((op.peer, rank), []).append(op.key)
    problems = []
    for pair in sorted(set(sent) | set(received)):
        s, r = sent.get(pair, []), received.get(pair, [])
        if s != r:
            i = next((i for i, (a, b) in enumerate(zip(s, r, strict=False)) if a != b), None)
            where = (
                f"message {i}: sent {s[i]}, received as {r[i]}"
                if i is not None
                else f"{len(s)} sent, {len(r)} received"
            )
            problems.append(f"rank {pair[0]} -> rank {pair[1]}: {where}")
    return problems


def forward_only_program(program):
    """The forward half of a GPU program (a coreset pool pass): F and EF, and the messages that
    carry activations forward."""
    keep = ("act", "eout", "eact")
    out = []
    for op in program:
        if op.kind == "run" and op.action.kind in ("F", "EF"):
            out.append(replace(op, fills=tuple(f for f in op.fills if f.kind == "EF")))
        elif op.kind == "run" and op.fills:
            out += [replace(op, action=f, fills=()) for f in op.fills if f.kind == "EF"]
        elif op.kind in ("send", "recv") and op.key.split(".")[0] in keep:
            out.append(op)
    return out
