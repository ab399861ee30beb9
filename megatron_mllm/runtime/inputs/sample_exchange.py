"""Dealing a step's samples into micro-batches of equal encoder loads (optimus-adaptive's
assignment at run time, with a per-token loss): within the replicas a process holds, or across
every DP replica when each process holds one, by exchanging only the samples that change
replica. A sample is a row: one conversation, or a packed row of several (which moves whole);
its load is its images (a native tower's by patches, `inputs.batches.encoder_load`).

Every replica reads its own stream, so no process sees the global batch. Each one all-gathers
its samples' loads, ids and image shapes over a gloo group of the ranks that share its TP and PP
coordinates (one per replica), computes the same assignment
(`schedule.loads.balanced_assignment`), and sends the samples it holds that another replica
trains: point-to-point on the host, each pair's messages in increasing sample order, so they
match by order without tags. The global batch is the same samples, so a per-token loss's
gradient is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_mllm.data.batch import MicroBatch, collate
from megatron_mllm.parallel.groups import backbone_rank
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.schedule.loads import balanced_assignment


def samples_of(batches: list[MicroBatch]) -> list[MicroBatch]:
    """Each sample (row) of `batches` as its own one-row micro-batch, in order."""
    return [mb.select([i]) for mb in batches for i in range(mb.num_samples)]


def deal_locally(
    replicas: list[list[MicroBatch]], load: Callable[[MicroBatch], float]
) -> list[list[MicroBatch]]:
    """Every replica's micro-batches (all held by this process, in replica order) dealt anew
    over the same replicas by `load` (a one-row micro-batch's encoder load): the assignment
    `deal_across` computes when each holds its own."""
    size = replicas[0][0].num_samples
    samples = [s for batches in replicas for s in samples_of(batches)]
    assignment = balanced_assignment([load(s) for s in samples], len(replicas), size)
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


def deal_across(
    batches: list[MicroBatch], group, load: Callable[[MicroBatch], float]
) -> list[MicroBatch]:
    """This replica's micro-batches once every replica's samples are dealt by `load`
    (collective over `group`, see the module docstring)."""
    me, dp = dist.get_rank(group), dist.get_world_size(group)
    held = samples_of(batches)
    gathered: list = [None] * dp
    dist.all_gather_object(gathered, [_header(s, load(s)) for s in held], group=group)
    headers = [h for replica in gathered for h in replica]
    assignment = balanced_assignment([h["load"] for h in headers], dp, batches[0].num_samples)
    owner = [g // len(held) for g in range(len(headers))]
    sent = _send_moved(held, assignment, owner, me, group)
    got = _receive_moved(batches[0], held, assignment[me], owner, headers, me, group)
    for work in sent:
        work.wait()
    return [collate([got[g] for g in mb]) for mb in assignment[me]]


def _header(sample: MicroBatch, load: float) -> dict:
    """What every replica learns of a sample before any is sent: its load, id, image rows
    (images, or a native tower's patches) and native grids."""
    grids = sample.grids.tolist() if sample.native else None
    return {"load": load, "ids": sample.ids[:1], "rows": sample.images.shape[0], "grids": grids}


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


def _receive_moved(first, held, mine, owner, headers, me: int, group) -> dict:
    """Global sample index -> one-row micro-batch for every sample this replica trains: its
    own, and the others' received (posted in sample order, then waited for)."""
    got, pending, works = {}, [], []
    lines = 5 if first.packed else 3
    for g in sorted({g for mb in mine for g in mb}):
        if owner[g] == me:
            got[g] = held[g % len(held)]
            continue
        src = dist.get_global_rank(group, owner[g])
        text = torch.empty(lines, first.tokens.shape[1], dtype=torch.long)
        images = first.images.new_empty(headers[g]["rows"], *first.images.shape[1:])
        works.append(dist.irecv(text, src, group=group))
        if headers[g]["rows"]:
            works.append(dist.irecv(images, src, group=group))
        pending.append((g, text, images))
    for work in works:
        work.wait()
    for g, text, images in pending:
        got[g] = _sample(first, text, images, headers[g])
    return got


def _packed(sample: MicroBatch) -> list[torch.Tensor]:
    """What is sent for one sample: tokens, labels, image mask (and a packed row's positions
    and segments) as one [3 or 5, s] tensor, then its images (none for a text-only one)."""
    lines = [sample.tokens[0], sample.labels[0], sample.image_mask[0]]
    if sample.packed:
        lines += [sample.positions[0], sample.segments[0]]
    text = torch.stack([t.long() for t in lines])
    return [text.contiguous()] + ([sample.images.contiguous()] if sample.images.shape[0] else [])


def _sample(first: MicroBatch, text, images, header: dict) -> MicroBatch:
    """A received sample, shaped as `first` (this replica's own first micro-batch) is."""
    native = {}
    if header["grids"] is not None:
        grids = torch.tensor(header["grids"], dtype=torch.long).reshape(-1, 3)
        native = {"grids": grids, "merge": first.merge}
    packed = {}
    if first.packed:
        packed = {"positions": text[3:4].clone(), "segments": text[4:5].to(first.segments.dtype)}
    return MicroBatch(
        images=images,
        tokens=text[0:1].to(first.tokens.dtype),
        labels=text[1:2].clone(),
        image_mask=text[2:3].bool(),
        ids=tuple(header["ids"]),
        image_tokens=first.image_tokens,
        **packed,
        **native,
    )
