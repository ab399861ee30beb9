"""The Megatron baselines, in the same IR as everything else.

* `megatron`: encoders and projectors in the pre-process of backbone stage 0, then 1F1B
  (interleaved 1F1B when VPP > 1). The backbone layers are split the way a Megatron user
  balances such a model: the first and last stage may hold a different number of layers
  (--decoder-first/last-pipeline-num-layers), chosen to even out the encoder and LM head.
* `balanced`: every layer, encoder layers included, over PP x VPP virtual stages by a dynamic
  program that minimises the slowest stage, then (interleaved) 1F1B.
"""

from __future__ import annotations

from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.schedule.actions import AG, EB, EF, RS, Action
from megatron_mllm.schedule.assemble import (
    EncoderLayout,
    assemble,
    megatron_backbone,
    stages_from_sizes,
)
from megatron_mllm.schedule.backbone_wgrad import check_backbone_tp, with_backbone_wgrad
from megatron_mllm.schedule.blocks import JobCosts, concat
from megatron_mllm.schedule.keys import part_name
from megatron_mllm.schedule.partition import balanced_partition
from megatron_mllm.schedule.pipeline_orders import backbone_actions, backbone_orders
from megatron_mllm.schedule.schedule import Schedule, ScheduleMeta
from megatron_mllm.schedule.transfers import add_transfers
from megatron_mllm.schedule.workload import Workload


def megatron_schedule(
    costs: JobCosts, even_split: bool = False, backbone_wgrad_split: bool = False
) -> tuple[Schedule, Workload]:
    """Encoders on stage 0's pre-process, then Megatron's (interleaved) 1F1B.

    `even_split`: Megatron's default even layer split instead of the balancing first/last
    stage sizes; `backbone_wgrad_split`: the backbone's backward split where a peer waits for
    it (`backbone_wgrad.with_backbone_wgrad`).
    """
    job, plan = costs.job, costs.job.plan
    encoders = [
        concat(costs.encoder_blocks(e, plan.tp), coalesce=costs.unit == "kernel")
        for e in range(len(job.encoders))
    ]
    encoder_cost = sum(JobCosts.fwd_bwd_seconds(b) for b in encoders)
    backbone, layers = megatron_backbone(costs, encoder_cost, even=even_split)
    layouts = [
        EncoderLayout([b], ParallelPlan(plan.dp, plan.tp, 1), (((0, 0),),)) for b in encoders
    ]
    meta, workload = assemble(
        "megatron", costs, backbone, layouts, slots=1, backbone_layers=layers, on_stage0=True
    )
    schedule = add_transfers(meta, _stage0_encoder_lists(meta))
    if backbone_wgrad_split:
        check_backbone_tp(plan.tp)
        schedule = with_backbone_wgrad(schedule, workload)
    return schedule, workload


def _stage0_encoder_lists(meta: ScheduleMeta) -> list[list[Action]]:
    enc_parts = [part_name(e) for e in range(len(meta.encoders))]
    trained = [part_name(e) for e, enc in enumerate(meta.encoders) if enc.trainable]
    ranks = []
    for r, order in enumerate(backbone_orders(meta)):
        acts: list[Action] = [AG("bb")] + ([AG(p) for p in enc_parts] if r == 0 else [])
        for main in backbone_actions(r, order):
            first = r == 0 and main.chunk == 0
            if first and main.kind == "F":
                acts += [
                    EF(e, 0, 0, main.mb, 0, enc.fwd_kernels[0])
                    for e, enc in enumerate(meta.encoders)
                ]
            acts.append(main)
            if first and main.kind == "B":
                acts += [
                    EB(e, 0, 0, main.mb, 0, enc.bwd_kernels[0])
                    for e, enc in enumerate(meta.encoders)
                    if enc.trainable
                ]
        acts += [RS("bb")] + ([RS(p) for p in trained] if r == 0 else [])
        ranks.append(acts)
    return ranks


def balanced_schedule(costs: JobCosts) -> tuple[Schedule, Workload]:
    """All layers over PP x VPP virtual stages, balanced by dynamic programming."""
    job, plan = costs.job, costs.job.plan
    blocks = [b for e in range(len(job.encoders)) for b in costs.encoder_blocks(e, plan.tp)]
    blocks += costs.backbone_blocks(plan.tp)
    sizes = balanced_partition([JobCosts.fwd_bwd_seconds(b) for b in blocks], plan.pp * plan.vpp)
    backbone = stages_from_sizes(plan.pp, blocks, sizes)
    meta, workload = assemble("balanced", costs, backbone, [], slots=1)
    start = 0
    for v, n in enumerate(sizes):  # the encoder work each virtual stage holds
        enc = [b for b in blocks[start : start + n] if "encoder" in b.tags]
        if enc:
            fwd = sum(k.compute_s for b in enc for k in b.fwd)
            workload.folded_encoder_s[(v % plan.pp, v // plan.pp)] = (
                fwd,
                sum(k.compute_s for b in enc for k in b.bwd),
            )
        start += n
    ranks = [
        [AG("bb"), *backbone_actions(r, order), RS("bb")]
        for r, order in enumerate(backbone_orders(meta))
    ]
    return add_transfers(meta, ranks), workload
