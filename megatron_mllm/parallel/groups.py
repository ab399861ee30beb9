"""Process groups for a backbone plan and an encoder plan colocated on the same ranks.

Built from megatron-core's HyperCommGrid and handed out as ProcessGroupCollections, never kept in
module globals. Rank layout (TP fastest, then DP, then PP, like megatron-core's default order):

    backbone rank  = t + TP * (d + DP * s)          t: TP rank, d: DP rank, s: pipeline stage
    encoder        = t_e + TP_e * (k + g * (d + DP * (r + R * j)))

with g = TP / TP_e slots per backbone stage, R = PP / PP_e rows, encoder pipeline p = r * g + k
(within backbone replica d) and encoder stage j on backbone stage j * R + r, or with the
encoder's stages reversed on stage (PP_e - 1 - j) * R + r: the placement the schedule core uses
(`plans.encoder_stage_placement`). The encoder's pipeline group ranks its members by encoder
stage either way (megatron-core reads a stage's layers from its rank in that group).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mllm.parallel.plans import ParallelPlan, check_colocated


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in both plans."""

    rank: int
    tp: int
    dp: int
    stage: int  # backbone pipeline stage
    enc_tp: int
    enc_slot: int
    enc_row: int
    enc_stage: int

    def encoder_pipe(self, slots: int) -> int:
        """Encoder pipeline index within this backbone replica."""
        return self.enc_row * slots + self.enc_slot


def rank_coords(rank: int, backbone: ParallelPlan, encoder: ParallelPlan) -> RankCoords:
    tp, dp, pp = backbone.tp, backbone.dp, backbone.pp
    t, rest = rank % tp, rank // tp
    d, s = rest % dp, rest // dp
    rows = pp // encoder.pp
    return RankCoords(
        rank,
        t,
        d,
        s,
        enc_tp=t % encoder.tp,
        enc_slot=t // encoder.tp,
        enc_row=s % rows,
        enc_stage=encoder.stage_block(s // rows),
    )


def backbone_rank(backbone: ParallelPlan, tp: int, dp: int, stage: int) -> int:
    return tp + backbone.tp * (dp + backbone.dp * stage)


def new_replica_mp_groups(backbone: ParallelPlan, dp: int):
    """A new group over each DP replica's backbone ranks (TP x PP), like `mp` but carrying
    nothing else; returns replica `dp`'s (collective: every rank creates all, in one order)."""
    import torch.distributed as dist

    mine = None
    for replica in range(backbone.dp):
        ranks = sorted(
            backbone_rank(backbone, tp, replica, s)
            for tp in range(backbone.tp)
            for s in range(backbone.pp)
        )
        group = dist.new_group(ranks)
        if replica == dp:
            mine = group
    return mine


@dataclass
class ColocatedGroups:
    """Both plans' process groups as megatron-core ProcessGroupCollections."""

    backbone_plan: ParallelPlan
    encoder_plan: ParallelPlan
    coords: RankCoords
    backbone: object  # ProcessGroupCollection: tp, pp, dp, cp, mp, embd, pos_embd, dp_cp, tp_cp
    encoder: object  # ProcessGroupCollection: tp, pp, dp, cp, ...
    solo: object = None  # a group of this rank alone

    def stage0_encoder(self):
        """Groups for an encoder kept whole on backbone stage 0 (Megatron's placement): the
        backbone's TP and DP, a pipeline of one."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        out = ProcessGroupCollection()
        out.tp, out.cp, out.dp, out.tp_cp = (
            self.backbone.tp,
            self.backbone.cp,
            self.backbone.dp,
            self.backbone.tp_cp,
        )
        out.dp_cp, out.pp, out.mp = self.backbone.dp_cp, self.solo, self.backbone.tp
        return out

    @property
    def slots(self) -> int:
        return self.backbone_plan.tp // self.encoder_plan.tp

    @property
    def encoder_pipe(self) -> int:
        return self.coords.encoder_pipe(self.slots)


def build_colocated_groups(
    backbone: ParallelPlan, encoder: ParallelPlan, world_size: int, rank: int
) -> ColocatedGroups:
    """Create every group (collective: all ranks must call). Plans are checked first."""
    check_colocated(backbone, encoder)
    if backbone.world_size != world_size:
        from megatron_mllm.errors import ConfigError

        raise ConfigError(
            f"plan {backbone} needs {backbone.world_size} ranks but the world has {world_size}"
        )
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    grid = HyperCommGrid([backbone.tp, 1, backbone.dp, backbone.pp], ["tp", "cp", "dp", "pp"])
    bb = ProcessGroupCollection()
    bb.tp, bb.cp, bb.dp, bb.pp = (grid.create_pg(d) for d in ("tp", "cp", "dp", "pp"))
    bb.mp = grid.create_pg(["tp", "pp"])
    bb.tp_cp = grid.create_pg(["tp", "cp"])
    bb.dp_cp = grid.create_pg(["cp", "dp"])
    # Embedding groups: first and last pipeline stage (one group per TP x DP position).
    bb.embd = _stage_edge_group(grid, backbone, rank, both_ends=True)
    bb.pos_embd = _stage_edge_group(grid, backbone, rank, both_ends=False)

    slots, rows = backbone.tp // encoder.tp, backbone.pp // encoder.pp
    egrid = HyperCommGrid(
        [encoder.tp, 1, slots, backbone.dp, rows, encoder.pp],
        ["tp", "cp", "slot", "dp", "row", "pp"],
    )
    enc = ProcessGroupCollection()
    enc.tp, enc.cp = (egrid.create_pg(d) for d in ("tp", "cp"))
    enc.pp = _encoder_pipeline_group(egrid, encoder, rank)
    enc.dp = egrid.create_pg(["slot", "dp", "row"])
    enc.mp = egrid.create_pg(["tp", "pp"])
    enc.tp_cp = egrid.create_pg(["tp", "cp"])
    enc.dp_cp = egrid.create_pg(["cp", "slot", "dp", "row"])
    import torch.distributed as dist

    solo, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world_size)])
    return ColocatedGroups(backbone, encoder, rank_coords(rank, backbone, encoder), bb, enc, solo)


def _encoder_pipeline_group(grid, encoder: ParallelPlan, rank: int):
    """The encoder's pipeline group, its members ranked by encoder stage: the grid's own, or
    with the stages reversed one listing them last backbone stage first."""
    if not encoder.reversed_stages:
        return grid.create_pg("pp")
    import torch.distributed as dist

    mine = None
    for ranks in grid.get_rank_enum("pp"):
        group = dist.new_group(ranks[::-1], sort_ranks=False)
        if rank in ranks:
            mine = group
    return mine


def _stage_edge_group(grid, plan: ParallelPlan, rank: int, both_ends: bool):
    """The group of the first (and last) pipeline stage ranks sharing TP and DP position."""
    import torch.distributed as dist

    mine = None
    for ranks in grid.get_rank_enum("pp"):
        members = sorted({ranks[0], ranks[-1]}) if both_ends else [ranks[0]]
        group = dist.new_group(members)
        if rank in members:
            mine = group
    return mine
