"""megatron-core's DistributedDataParallel around each part of a rank's model, each on its own
plan's DP group: every backbone chunk on the backbone's, every encoder stage on the encoder
plan's (colocated on the same ranks). The schedule's RS action of a part is its gradient
reduction:

* without `overlap_grad_reduce`: the bucketed reduction runs at step end (as megatron-core's
  finalize_model_grads does), every rank taking the parts in the same (sorted) order: two
  parts' collectives issued in rank-dependent program order could deadlock on NCCL, where a
  synchronous collective makes the next one's stream wait;
* with it: each bucket is reduced asynchronously as soon as the last backward that touches it
  has run (megatron-core's gradient hooks count the step's gradients per parameter; the counts
  are learnt on the first step, whose reduction starts at step end), so an encoder's reduction
  overlaps the backbone's remaining backward work; RS marks where it must have started.

Under the distributed optimizer RS is a reduce-scatter, and the step's update is all-gathered:
at the optimizer step (megatron-core's default; the schedule's AG then has nothing to do) or,
with `overlap_gather` (--overlap-param-gather), started by the part's AG action and waited for
before its first forward, so an encoder's gather hides behind the backbone's warm-up.

Every reduction is waited for at step end; gradients are then in each parameter's `main_grad`
(megatron-core's buffer), exposed as `.grad` for clipping, the optimizer and result checks
(not under the distributed optimizer, whose main_grad holds only this rank's reduced shard
and which reads it itself).
The encoder's DP group holds m pipelines per backbone replica, each with its own micro-batches:
their gradients add up, then average over the backbone's replicas (`divide_by`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch


def dedicated_group(group):
    """A new process group with `group`'s members, created collectively (every rank calls it,
    each with its own group; the groups must partition the world). Each part reduces on a group
    of its own: collectives on one group must be issued in one order on every rank, and two
    parts' buckets (two encoders, or an encoder on stage 0 beside the backbone) become ready in
    rank-dependent order when the ranks run different programs."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, tuple(dist.get_process_group_ranks(group)))
    from megatron_mllm.runtime.assembly.bootstrap import partition_subgroups

    return partition_subgroups([list(r) for r in sorted(set(every))])


def ddp_groups(pg, dp_group, solo):
    """The part's ProcessGroupCollection as DDP and the optimizer read it: its DP group, no
    experts."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    out = ProcessGroupCollection()
    for name in ("tp", "cp", "pp", "mp", "tp_cp"):
        setattr(out, name, getattr(pg, name, None))
    out.dp = out.dp_cp = dp_group
    out.ep = out.expt_dp = solo
    out.tp_ep_pp = None  # no experts
    # The distributed optimizer sums its gradient statistics (the norm) over every rank that
    # holds a shard of the part: each part spans the whole world (both plans cover every rank).
    out.intra_dist_opt = dist.group.WORLD
    return out


@dataclass
class PartGradSync:
    """One part's DDP instances (one per module) and how its RS action behaves."""

    ddps: list
    overlap: bool
    pg: object  # the part's groups as megatron-core's DDP and optimizer read them
    distributed: bool = False  # the distributed optimizer: RS reduce-scatters, shards only
    overlap_gather: bool = False  # AG starts the parameter all-gather; the first use waits
    in_flight_at_rs: list[int] = field(default_factory=list)  # per step: buckets already started
    stale: bool = False  # overlap_gather: the optimizer stepped; other shards not yet gathered
    gathering: bool = False

    @property
    def buckets(self) -> int:
        return sum(len(ddp.bucket_groups) for ddp in self.ddps)

    def mark(self) -> None:
        """The RS action: record how many buckets are already reducing (with overlap, all of
        them from the second step on; the hooks started them)."""
        groups = [g for ddp in self.ddps for g in ddp.bucket_groups]
        self.in_flight_at_rs.append(sum(g.grad_reduce_handle is not None for g in groups))

    def no_gradient(self, params) -> None:
        """A backward that had nothing to do (a micro-batch without images): with overlap its
        parameters count as ready, as their hooks would have counted them, so each bucket
        starts its reduction after the step's last backward whatever the data held."""
        if not self.overlap:
            return
        wanted = set(params)
        for ddp in self.ddps:  # bucket by bucket, the order a real backward readies them in
            for group in ddp.bucket_groups:
                for p in group.params:
                    if p in wanted:
                        group.register_grad_ready(p)

    def finish(self) -> None:
        """At step end (every rank takes the parts in one order): the reduction without
        overlap, bucketed; with it, the wait (the first step also starts it here)."""
        for ddp in self.ddps:
            ddp.finish_grad_sync()
            if self.distributed:
                continue  # main_grad holds only this rank's reduced shard; the optimizer reads it
            for p in ddp.module.parameters():
                if p.requires_grad:
                    p.grad = p.main_grad

    def start_gather(self) -> None:
        """The AG action under overlapped parameter gathering: dispatch every bucket's
        all-gather of the parameters the last optimizer step updated (asynchronous)."""
        if self.stale and not self.gathering:
            for ddp in self.ddps:
                ddp.start_param_sync()
            self.gathering = True

    def finish_gather(self) -> bool:
        """Before the part's first forward of a step (and before its parameters are read):
        wait for the all-gather, dispatching it now where no AG started it. True if the
        parameters were stale."""
        if not self.stale:
            return False
        for ddp in self.ddps:
            for group in ddp.bucket_groups:
                group.finish_param_sync(skip_next_bucket_dispatch=True)
        self.stale = self.gathering = False
        return True

    def stepped(self) -> None:
        """After an optimizer step: with overlapped gathering only this rank's shards are new."""
        self.stale = self.overlap_gather

    def relearn(self) -> None:
        """After re-planning: the new program may run another number of backward passes per
        parameter, so the next step learns the per-parameter counts again (megatron-core's
        first-batch mode of its bucket groups; 0.16.1's attribute names)."""
        for ddp in self.ddps:
            for g in ddp.bucket_groups:
                g.is_first_batch = True
                g.golden_per_param_grad_ready_counts = {}
                g.per_param_grad_ready_counts = {}

    def zero(self) -> None:
        """Before a step's first backward: empty the gradient buffers (and bucket counts)."""
        for ddp in self.ddps:
            ddp.zero_grad_buffer()


@contextlib.contextmanager
def reductions_held(syncs: Iterable[PartGradSync]) -> Iterator[list]:
    """Inside: a bucket whose gradients become ready (an encoder backward run as a fill inside
    a backbone TP collective's wait) starts its reduction only on leaving, in the order they
    became ready. On NCCL a reduction started inside that wait would be ordered against the TP
    collective differently on ranks whose backward ran outside one. Yields the held list."""
    held: list = []
    groups = [g for s in syncs if s.overlap for ddp in s.ddps for g in ddp.bucket_groups]

    def holder(group):
        return lambda force_all_reduce=False: held.append((group, force_all_reduce))

    for g in groups:
        g.start_grad_sync = holder(g)  # an instance attribute over the class's method
    try:
        yield held
    finally:
        for g in groups:
            del g.start_grad_sync
        for g, force in held:
            g.start_grad_sync(force_all_reduce=force)


def wrap_part(
    modules: list[torch.nn.Module],
    pg,
    dp_group,
    solo,
    divide_by: int,
    overlap: bool = False,
    bucket_size: int | None = None,
    distributed: bool = False,
    overlap_gather: bool = False,
    grad_reduce_in_fp32: bool = True,
) -> PartGradSync:
    """megatron-core DDP around each module of one part (their parameters stay the modules')."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    groups = ddp_groups(pg, dp_group, solo)
    ddps = []
    for module in modules:
        config = DistributedDataParallelConfig(
            overlap_grad_reduce=overlap,
            bucket_size=bucket_size if overlap else None,
            use_distributed_optimizer=distributed,
            overlap_param_gather=overlap_gather,
            grad_reduce_in_fp32=grad_reduce_in_fp32,  # --accumulate-allreduce-grads-in-fp32
        )
        ddp = DistributedDataParallel(_config_of(module), config, module, pg_collection=groups)
        if overlap_gather:  # the schedule's AG and first use drive it, not forward pre-hooks
            # (a kernel-sized unit or a parameter read outside a module call passes no hook)
            ddp.disable_forward_pre_hook(param_sync=False)
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                bucket.gradient_scaling_factor = 1.0 / divide_by
        ddps.append(ddp)
    return PartGradSync(ddps, overlap, groups, distributed, overlap_gather)


def _config_of(module: torch.nn.Module):
    """The TransformerConfig of a BackboneStage or an EncoderStage."""
    gpt = getattr(module, "gpt", None)
    return gpt.config if gpt is not None else module.block.config
