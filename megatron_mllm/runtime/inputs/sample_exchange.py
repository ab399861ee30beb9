"""Dealing a step's samples into micro-batches of equal image counts (optimus-adaptive's
assignment at run time, with a per-token loss): within the replicas a process holds, or across
every DP replica when each process holds one, by exchanging only the samples that change
replica.

Every replica reads its own stream, so no process sees the global batch. Each one all-gathers
its samples' image counts and ids over a gloo group of the ranks that share its TP and PP
coordinates (one per replica), computes the same assignment
(`schedule.loads.balanced_assignment`), and sends the samples it holds that another replica
trains: point-to-point on the host, each pair's messages in increasing sample order, so they
match by order without tags. The global batch is the same samples, so a per-token loss's
gradient is unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_mllm.data.batch import MicroBatch, collate
from megatron_mllm.parallel.groups import backbone_rank
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.schedule.loads import balanced_assignment


def samples_of(batches: list[MicroBatch]) -> list[MicroBatch]:
    """Each sample of `batches` as its own one-sample micro-batch, in order."""
    return [mb.select([i], mb.image_tokens) for mb in batches for i in range(mb.num_samples)]


def deal_locally(replicas: list[list[MicroBatch]]) -> list[list[MicroBatch]]:
    """Every replica's micro-batches (all held by this process, in replica order) dealt anew
    over the same replicas: the assignment `deal_across` computes when each holds its own."""
    size = replicas[0][0].num_samples
    samples = [s for batches in replicas for s in samples_of(batches)]
    assignment = balanced_assignment([s.num_images for s in samples], len(replicas), size)
    return [[collate([samples[g] for g in mb]) for mb in replica] for replica in assignment]


def dp_exchange_group(plan: ParallelPlan, rank: int):
    """The gloo group of the ranks sharing `rank`'s TP and PP coordinates, one per replica,
    in replica order. Collective: every rank creates every such group (a partition of the
    ranks, see `partition_subgroups`)."""
    lists = [
        [backbone_rank(plan, tp, dp, stage) for dp in range(plan.dp)]
        for stage in range(plan.pp)
        for tp in range(plan.tp)
    ]
    from megatron_mllm.runtime.assembly.bootstrap import partition_subgroups

    return partition_subgroups(lists, backend="gloo")


def deal_across(batches: list[MicroBatch], group) -> list[MicroBatch]:
    """This replica's micro-batches once every replica's samples are dealt by images
    (collective over `group`, see the module docstring)."""
    me, dp = dist.get_rank(group), dist.get_world_size(group)
    held = samples_of(batches)
    gathered: list = [None] * dp
    dist.all_gather_object(gathered, [(s.num_images, s.ids[:1]) for s in held], group=group)
    counts = [count for replica in gathered for count, _ in replica]
    ids = [sample_id for replica in gathered for _, sample_id in replica]
    assignment = balanced_assignment(counts, dp, batches[0].num_samples)
    owner = [g // len(held) for g in range(len(counts))]
    sent = _send_moved(held, assignment, owner, me, group)
    got = _receive_moved(batches[0], held, assignment[me], owner, counts, ids, me, group)
    for work in sent:
        work.wait()
    return [collate([got[g] for g in mb]) for mb in assignment[me]]


def _send_moved(held, assignment, owner: list[int], me: int, group) -> list:
    """Post the sends of the samples this replica holds that another trains (each pair's in
    sample order); the works keep their tensors alive until waited for."""
    works = []
    for q, replica in enumerate(assignment):
        if q != me:
            dst = dist.get_global_rank(group, q)
            for g in sorted(g for mb in replica for g in mb if owner[g] == me):
                works += [dist.isend(t, dst, group=group) for t in _packed(held[g % len(held)])]
    return works


def _receive_moved(first, held, mine, owner, counts, ids, me: int, group) -> dict:
    """Global sample index -> one-sample micro-batch for every sample this replica trains:
    its own, and the others' received (posted in sample order, then waited for)."""
    layout = (tuple(first.images.shape[1:]), first.images.dtype, first.tokens.dtype)
    got, pending, works = {}, [], []
    for g in sorted({g for mb in mine for g in mb}):
        if owner[g] == me:
            got[g] = held[g % len(held)]
            continue
        src = dist.get_global_rank(group, owner[g])
        text, images = _buffers(first.tokens.shape[1], counts[g], layout)
        works.append(dist.irecv(text, src, group=group))
        if counts[g]:
            works.append(dist.irecv(images, src, group=group))
        pending.append((g, text, images))
    for work in works:
        work.wait()
    for g, text, images in pending:
        got[g] = _sample(text, images, ids[g], first.image_tokens, layout[2])
    return got


def _packed(sample: MicroBatch) -> list[torch.Tensor]:
    """What is sent for one sample: tokens, labels and image mask as one [3, s] tensor, then
    its images (none for a text-only sample)."""
    text = torch.stack(
        [sample.tokens[0].long(), sample.labels[0].long(), sample.image_mask[0].long()]
    )
    return [text.contiguous()] + ([sample.images.contiguous()] if sample.num_images else [])


def _buffers(seq: int, count: int, layout) -> tuple[torch.Tensor, torch.Tensor]:
    shape, dtype, _ = layout
    return torch.empty(3, seq, dtype=torch.long), torch.empty(count, *shape, dtype=dtype)


def _sample(text, images, ids, image_tokens: int, token_dtype) -> MicroBatch:
    return MicroBatch(
        images=images,
        tokens=text[0:1].to(token_dtype),
        labels=text[1:2].clone(),
        image_mask=text[2:3].bool(),
        ids=tuple(ids),
        image_tokens=image_tokens,
    )
