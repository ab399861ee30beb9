"""Turn stage blocks and a placement into a `ScheduleMeta` and its `Workload`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.schedule.blocks import Block, JobCosts, concat, state_bytes
from megatron_mllm.schedule.keys import cost_name, part_name
from megatron_mllm.schedule.schedule import EncoderMeta, ScheduleMeta
from megatron_mllm.schedule.workload import Workload


@dataclass
class EncoderLayout:
    """One encoder's stages (blocks, fine-grained kernels) and where its pipelines live."""

    stages: list[Block]
    plan: ParallelPlan
    placement: tuple[tuple[tuple[int, int], ...], ...]  # [pipe][stage] -> (rank, slot)


def assemble(
    name: str,
    costs: JobCosts,
    backbone: dict[tuple[int, int], Block],
    encoders: list[EncoderLayout],
    slots: int,
    state_blocks: dict[int, list[tuple[Block, int]]] | None = None,
    backbone_layers: tuple[int, ...] = (),
    on_stage0: bool = False,
) -> tuple[ScheduleMeta, Workload]:
    """Metadata and costs for a schedule with these backbone stages and encoder layouts.

    `backbone[(stage, chunk)]` holds each virtual stage's work (with encoder layers folded in
    for the balanced baseline). `state_blocks` adds per-rank blocks with their DP size for the
    memory estimate (the encoder stages are added from `encoders`).
    """
    job = costs.job
    plan = job.plan
    cm = costs.cm
    meta = ScheduleMeta(
        pp=plan.pp,
        vpp=plan.vpp,
        num_microbatches=job.num_microbatches,
        slots=slots,
        encoders=tuple(
            EncoderMeta(
                job.encoders[e].name,
                tuple(len(b.fwd) for b in lay.stages),
                tuple(len(b.bwd) for b in lay.stages),
                lay.placement,
            )
            for e, lay in enumerate(encoders)
        ),
        name=name,
        backbone_layers=backbone_layers,
        encoder_plan=(encoders[0].plan.dp, encoders[0].plan.tp, encoders[0].plan.pp)
        if encoders
        else (),
        encoder_on_stage0=on_stage0 and bool(encoders),
    )
    llm_h = job.backbone.hidden_size
    wl = Workload(
        backbone_fwd={k: b.fwd for k, b in backbone.items()},
        backbone_bwd={k: b.bwd for k, b in backbone.items()},
        encoder_fwd=[[b.fwd for b in lay.stages] for lay in encoders],
        encoder_bwd=[[b.bwd for b in lay.stages] for lay in encoders],
        backbone_act_bytes={k: b.act_bytes for k, b in backbone.items()},
        encoder_act_bytes=[[b.act_bytes for b in lay.stages] for lay in encoders],
        memory_bytes=job.hw.memory_gb * 1e9,
        # measured times already hold each chunk's overhead
        chunk_overhead_s=0.0 if cm.measured else job.hw.chunk_overhead_s,
    )
    wl.transfer_s[cost_name("act")] = wl.transfer_s[cost_name("grad")] = cm.p2p_s(
        llm_h, job.seq_len, plan.tp
    )
    state = [0.0] * plan.pp
    for s in range(plan.pp):
        blocks = [backbone[(s, v)] for v in range(plan.vpp)]
        if s == 0 and job.backbone.vocab_size:
            blocks.append(costs.embedding(plan.tp))
        wl.dp_s[(s, "AG", "bb")] = cm.dp_gather_s(sum(b.params for b in blocks), plan.dp)
        wl.dp_s[(s, "RS", "bb")] = cm.dp_reduce_scatter_s(
            sum(b.trainable_params for b in blocks), plan.dp
        )
        wl.dp_buckets[(s, "bb")] = buckets(sum(b.trainable_params for b in blocks), plan.dp, job)
        state[s] += sum(state_bytes(b, plan.dp) for b in blocks)
    for e, lay in enumerate(encoders):
        seq = job.encoder_seq(job.encoders[e])
        enc_h = job.encoders[e].hidden_size
        llm_s, enc_s = cm.p2p_s(llm_h, seq, lay.plan.tp), cm.p2p_s(enc_h, seq, lay.plan.tp)
        wl.transfer_s[cost_name("eout", e)] = wl.transfer_s[cost_name("egrad", e)] = llm_s
        wl.transfer_s[cost_name("eact", e)] = wl.transfer_s[cost_name("egin", e)] = enc_s
        for j, block in enumerate(lay.stages):
            peers = tuple(sorted({pipe[j][0] for pipe in lay.placement}))
            for r in peers:
                if len(peers) > 1:
                    wl.dp_peers[(r, part_name(e))] = peers
                wl.dp_s[(r, "AG", part_name(e))] = cm.dp_gather_s(block.params, lay.plan.dp)
                wl.dp_s[(r, "RS", part_name(e))] = cm.dp_reduce_scatter_s(
                    block.trainable_params, lay.plan.dp
                )
                wl.dp_buckets[(r, part_name(e))] = buckets(block.trainable_params, lay.plan.dp, job)
                state[r] += state_bytes(block, lay.plan.dp)
    for r, extra in (state_blocks or {}).items():
        state[r] += sum(state_bytes(b, dp) for b, dp in extra)
    wl.state_bytes = state
    return meta, wl


def buckets(params: float, dp: int, job) -> int:
    """megatron-core DDP's gradient buckets for `params` on one GPU: its bucket size, by
    default max(40M, 1M x DP) parameters (DistributedDataParallel.__init__, 0.16.1)."""
    size = job.ddp_bucket_size or max(40_000_000, 1_000_000 * dp)
    return max(1, math.ceil(params / size))


def stages_from_sizes(
    pp: int, blocks: list[Block], sizes: list[int]
) -> dict[tuple[int, int], Block]:
    """Virtual stage v = chunk * PP + stage gets the next `sizes[v]` blocks (kernels coalesced)."""
    out, i = {}, 0
    for v, n in enumerate(sizes):
        out[(v % pp, v // pp)] = concat(blocks[i : i + n], coalesce=True)
        i += n
    return out


def megatron_backbone(
    costs: JobCosts, first_extra: float, even: bool = False
) -> tuple[dict[tuple[int, int], Block], tuple[int, ...]]:
    """Backbone stages split as the job fixes them, else as a Megatron user would balance them
    (see `partition.megatron_split`), or as evenly as megatron-core can build them (`even`);
    also the layers per virtual stage. The LM head rides with the last stage."""
    from megatron_mllm.schedule.partition import first_last_split, megatron_split

    job, plan = costs.job, costs.job.plan
    layer, head = costs.backbone_layer(plan.tp), costs.head(plan.tp)
    n = job.backbone.num_layers
    if job.backbone_split:
        sizes = list(job.backbone_split)
    elif even and plan.vpp == 1:
        sizes = first_last_split(n, plan.pp)
    elif even:
        base, rest = divmod(n, plan.pp * plan.vpp)
        sizes = [base + (1 if i < rest else 0) for i in range(plan.pp * plan.vpp)]
    else:
        sizes = megatron_split(
            n,
            plan.pp,
            plan.vpp,
            JobCosts.fwd_bwd_seconds(layer),
            first_extra,
            JobCosts.fwd_bwd_seconds(head),
        )
    layers = tuple(sizes)
    sizes[-1] += 1
    rc = job.recompute
    if rc.granularity == "full" and rc.method == "block":  # the first N of each chunk
        again = costs.backbone_layer(plan.tp, recomputed=True)
        blocks = [
            b
            for k in layers
            for b in [again] * min(k, rc.num_layers) + [layer] * (k - rc.num_layers)
        ]
        return stages_from_sizes(plan.pp, [*blocks, head], sizes), layers
    return stages_from_sizes(plan.pp, [layer] * n + [head], sizes), layers
