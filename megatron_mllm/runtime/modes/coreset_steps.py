"""The coreset sampler (CoLM) inside one ExecutorRun: each step trains on B samples chosen
from a pool of r x B, chosen now (the pool goes forward through the pipeline without
gradients, then the last stage selects on its output layer and every stage gets the rows) or
one step ahead (--coreset-lookahead: the next step's pool goes forward in this step's bubbles;
the last stage keeps its output-layer inputs and weight, selects after the update, and
broadcasts the rows asynchronously on a group of their own; the other stages take them when the
next step first needs one of its micro-batches, so that the selection overlaps their work)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_mllm.data.batch import MicroBatch, collate
from megatron_mllm.data.sampler import broadcast_selection
from megatron_mllm.parallel.groups import backbone_rank, new_replica_mp_groups
from megatron_mllm.runtime.engine.program import forward_only_program, gpu_program
from megatron_mllm.runtime.engine.step_types import PassKind


class CoresetSteps:
    """Selection for an ExecutorRun (`run`): its programs, its selector and, under look-ahead,
    the rows chosen for the next step (`pending`, saved in checkpoints)."""

    def __init__(self, run) -> None:
        from megatron_mllm.data.coreset import CoresetSelector

        self.run, job = run, run.job
        self.selector = CoresetSelector(job.data.coreset)
        self.measured: dict | None = None  # a re-plan's unit times, for pool passes of a count
        self.rebuild()
        self.rows_group = None  # look-ahead: this replica's pipeline, for the rows alone
        if self.lookahead:
            # The rows' broadcast is left pending across the update: on a group of its own it
            # pairs with nothing else.
            self.rows_group = new_replica_mp_groups(job.backbone, run.groups.coords.dp)
        # Look-ahead: (step, chosen rows), rows None until they arrive (stages before the last).
        self.pending: tuple[int, list[int] | None] | None = None
        self._deferred: tuple | None = None  # (step, what the last stage selects from, or None)
        self._next_pool: tuple | None = None  # look-ahead: (step, its pool collated), read ahead
        self._posted: tuple | None = None  # last stage: (the rows' broadcast, its buffer)
        # Look-ahead: select after the update (True) or before it, the rows shared at once (the
        # benchmark's ablation).
        self.defer = True
        # Same-step selection: only the scored rows go forward (False: the whole pool, the
        # benchmark's ablation; look-ahead always forwards only the scored rows).
        self.score_only = True

    @property
    def job(self):
        return self.run.job

    def rebuild(self) -> None:
        """This rank's programs of the job's pool pass and look-ahead step (at start and after
        a re-plan); those of fewer micro-batches are made again as counts come."""
        run, data = self.run, self.job.data
        pool = gpu_program(data.pool_schedule, run.groups, run.enc_tp)
        self.pool_program = forward_only_program(pool)
        self.ahead_program = None  # look-ahead: the step with the next step's pool forward
        if data.lookahead_schedule is not None:
            self.ahead_program = gpu_program(data.lookahead_schedule, run.groups, run.enc_tp)
        self._passes: dict[int, tuple] = {}  # pool passes of fewer micro-batches, by count
        self._aheads: dict[int, tuple] = {}  # look-ahead steps of fewer pool micro-batches

    def replanned_data(self, step, workload, measured: dict):
        """The job's DataParts for a re-planned `step` (its costs `workload`, from the unit
        times `measured` in the job): the pool pass planned again on those times and, under
        look-ahead, the merge made again (--coreset-lookahead-order's; every rank alike)."""
        from megatron_mllm.schedule.lookahead import lookahead_merge

        data, size = self.job.data, self.job.data.pool_schedule.meta.num_microbatches
        self.measured = measured
        pool = self._pool_schedule(step, size)
        ahead = None
        if data.lookahead_schedule is not None:
            order, counts = data.lookahead_order, range(1, size)
            ahead = lookahead_merge(step, pool, workload, order, counts)
        return replace(data, pool_schedule=pool, lookahead_schedule=ahead)

    def _pool_schedule(self, step, n: int):
        """A pool pass of `n` micro-batches for `step`'s modules (on the re-plan's times)."""
        from megatron_mllm.runtime.planning.schedules import pool_plan

        job = self.job
        return pool_plan(
            step,
            job.cfg,
            job.backbone,
            job.micro_batch,
            n,
            unit=job.plans.encoder_units,
            frozen_encoder=job.model.frozen_encoder,
            measured=self.measured,
        )[0]

    @property
    def lookahead(self) -> bool:
        return self.ahead_program is not None

    def with_next_pool(self, step: int, get: Callable) -> tuple:
        """Look-ahead: (program, meta, receive orders, get, the next pool, its picker) of step
        `step` with step + 1's pool (read now) going forward in its bubbles: micro-batch m is
        the step's own below n, the pool's from there."""
        n = self.job.num_microbatches
        pool = self.pool_list(self.run.data.prefetch_pool(step + 1))
        whole = collate(pool)
        self._next_pool = (step + 1, whole)  # what step + 1 picks its rows from
        scored = self._scored(whole)
        forward = self._scored_batches(whole, scored)  # only the rows the selection scores

        def with_pool(m: int) -> MicroBatch:
            return get(m) if m < n else forward[m - n]

        program, meta, ordered = self._ahead_pass(len(forward))
        picker = self._picker(whole, scored, n)
        return program, meta, ordered, with_pool, pool, picker

    def keep(self, step: int, kept: tuple | None) -> None:
        """Look-ahead: what the last stage selects `step`'s rows from (`_picker`'s), after the
        update (`after_update`); None on the other stages."""
        if self.defer:
            self._deferred = (step, kept)
            return
        self.pending = (step, self._share(self._pick_scored(*kept) if kept is not None else None))

    def after_update(self) -> None:
        """Look-ahead, after the optimizer step: the last stage selects (with the weights the
        pool went forward with) and posts the rows' broadcast; the others take them later."""
        if self._deferred is None:
            return
        (step, kept), self._deferred = self._deferred, None
        if kept is None:
            self.pending = (step, None)
            return
        rows = self._pick_scored(*kept)
        self._wait_posted()
        buf = rows.to(self.run.device, dtype=torch.long, copy=True)
        work = None
        if dist.get_world_size(self.rows_group) > 1:
            work = dist.broadcast(buf, src=self._last_rank(), group=self.rows_group, async_op=True)
        self._posted = (work, buf)
        self.pending = (step, rows.tolist())

    def settle(self) -> None:
        """Look-ahead: every rank holds the pending rows (collective over the rows' group:
        before a save, an evaluation and the run's end, and when a step first needs them)."""
        if self.pending is not None and self.pending[1] is None:
            size, src = self.job.data.coreset.batch_size, self._last_rank()
            rows = broadcast_selection(None, size, self.rows_group, src, self.run.device)
            self.pending = (self.pending[0], rows.tolist())
        self._wait_posted()

    def _wait_posted(self) -> None:
        if self._posted is not None and self._posted[0] is not None:
            self._posted[0].wait()
        self._posted = None

    def _last_rank(self) -> int:
        """This replica's last-stage rank (TP rank 0): the rows' source."""
        plan = self.job.backbone
        return backbone_rank(plan, 0, self.run.groups.coords.dp, plan.pp - 1)

    def data(self, step: int) -> Callable[..., MicroBatch]:
        """Coreset: `get(mb, dp)` over the B samples step `step` trains on: chosen one step
        ahead (look-ahead), or now from the step's pool (`select`)."""
        pool = self.run.data.pool(step)  # read one step ahead under look-ahead
        if self.pending is None or self.pending[0] != step:
            return self.select(pool)
        whole = self._read_ahead_pool(step, pool)
        if self.pending[1] is not None:
            return self._chosen(whole, self.pending[1])
        chosen: list[Callable[..., MicroBatch]] = []

        def when_needed(m: int, dp: int) -> MicroBatch:  # the rows may still be on their way
            if not chosen:
                self.settle()
                chosen.append(self._chosen(whole, self.pending[1]))
            return chosen[0](m, dp)

        return when_needed

    def _read_ahead_pool(self, step: int, pool) -> MicroBatch:
        """Look-ahead: `step`'s pool collated, as the previous step read it for its forward
        (read again from `pool` after a resume)."""
        if self._next_pool is not None and self._next_pool[0] == step:
            return self._next_pool[1]
        return collate(self.pool_list(pool))

    def pool_list(self, pool) -> list[MicroBatch]:
        """This replica's pool micro-batches."""
        n = self.job.data.coreset.pool_size // self.job.micro_batch
        return [pool(m, self.run.groups.coords.dp) for m in range(n)]

    def select(self, pool) -> Callable[..., MicroBatch]:
        """Coreset: the pool `pool(mb, dp)` goes forward without gradients through the whole
        pipeline; the last stage computes features on its output layer and selects B samples,
        every rank of the pipeline gets their positions; returns `get(mb, dp)` over them."""
        batches = self.pool_list(pool)
        return self._chosen(collate(batches), self.pool_rows(batches))

    def pool_rows(self, batches: list[MicroBatch]) -> list[int]:
        """The rows of the pool `batches` to train on, chosen now with the current weights
        (collective). Only the rows the selection scores go forward through the pipeline
        (without gradients); the rows of sources kept whole do not (`score_only`)."""
        whole = collate(batches)
        scored = self._scored(whole)
        if self.score_only:
            hidden_of, take = self._forward(self._scored_batches(whole, scored)), None
        else:  # the ablation: every pool row goes forward, the scored ones are read
            hidden_of, take = self._forward(batches), scored
        return self._share(self._pick_scored(whole, scored, hidden_of, take=take))

    def _scored(self, whole: MicroBatch) -> list[int]:
        """The pool rows the selection scores (its sources' ids are host data)."""
        return self.selector.scored_rows(torch.tensor(whole.sources, device="cpu")).tolist()

    def _forward(self, batches: list[MicroBatch]) -> dict:
        """The output layer's inputs per micro-batch after a forward-only pass of `batches`
        through the pipeline (collective; empty on other stages and for no batches)."""
        if not batches:
            return {}
        run = self.run
        run.sync_params()  # the pool pass has no AG actions
        program, meta, ordered = self._pool_pass(len(batches))
        executor = run.executor_for(
            program, meta, batches.__getitem__, kind=PassKind.POOL, ordered=ordered
        )
        executor.run_step()
        return executor.last_layer_inputs

    def _scored_batches(self, whole: MicroBatch, scored: list[int]) -> list[MicroBatch]:
        """The scored rows in micro-batches of the job's size, the last one filled up with
        copies of the last row (their outputs are dropped)."""
        mb = self.job.micro_batch
        padded = scored + scored[-1:] * (-len(scored) % mb)
        return [whole.select(padded[m : m + mb]) for m in range(0, len(padded), mb)]

    def _pool_pass(self, n: int) -> tuple:
        """(program, schedule metadata, receive orders) of a pool pass of `n` micro-batches:
        the job's own pool schedule for the whole pool, else one planned alike for `n` (made
        once per count)."""
        run, job = self.run, self.job
        if n == job.data.pool_schedule.meta.num_microbatches:
            return self.pool_program, job.data.pool_schedule.meta, run.pool_ordered
        if n not in self._passes:
            schedule = self._pool_schedule(job.schedule, n)
            self._passes[n] = self._built(schedule, run.pool_ordered, forward_only=True)
        return self._passes[n]

    def _ahead_pass(self, n: int) -> tuple:
        """(program, schedule metadata, receive orders) of the look-ahead step with `n` pool
        micro-batches going forward: the job's merge for the whole pool, else that merge with
        its first `n` (made once per count)."""
        from megatron_mllm.schedule.lookahead import with_fewer_ahead

        run, merged = self.run, self.job.data.lookahead_schedule
        if n == merged.meta.lookahead:
            return self.ahead_program, merged.meta, run.ahead_ordered
        if n not in self._aheads:
            fewer = with_fewer_ahead(merged, n)
            self._aheads[n] = self._built(fewer, run.ahead_ordered, forward_only=False)
        return self._aheads[n]

    def _built(self, schedule, whole_ordered: tuple | None, forward_only: bool) -> tuple:
        """(program, metadata, receive orders) of `schedule` on this rank; with ordered
        messages they go on the groups of `whole_ordered` (the whole pool's pass, whose
        message pairs hold these)."""
        from megatron_mllm.runtime.engine.program import all_programs, receive_orders
        from megatron_mllm.runtime.job import encoder_plan_of

        run, plan = self.run, self.job.backbone
        only = forward_only_program if forward_only else (lambda program: program)
        ordered = None
        if whole_ordered is not None:
            enc_plan, _ = encoder_plan_of(schedule, plan)
            programs = all_programs(schedule, plan, enc_plan, run.enc_tp)
            orders = receive_orders({r: only(p) for r, p in programs.items()}, run.rank)
            ordered = (orders, whole_ordered[1])
        return only(gpu_program(schedule, run.groups, run.enc_tp)), schedule.meta, ordered

    def _pick_scored(
        self,
        whole: MicroBatch,
        scored: list[int],
        hidden_of: dict,
        weight: torch.Tensor | None = None,
        take: list[int] | None = None,
    ) -> torch.Tensor | None:
        """On the last stage (collective over its TP group): the rows selected from the
        scored rows' output-layer inputs, rows `take` of `hidden_of[mb]` concatenated (default:
        the first ones, `_scored_batches`' order), and the output layer's weight (`weight`, or
        the current one); None on other stages."""
        backbone = self.run.backbone
        if not backbone.post_process:
            return None
        weight = (backbone.gpt.output_layer.weight if weight is None else weight).detach().float()
        hidden = None
        if hidden_of:  # the replay runs in fp32 on what the pipeline computed
            hidden = torch.cat([hidden_of[m] for m in range(len(hidden_of))])
            rows = slice(len(scored)) if take is None else torch.tensor(take, device=hidden.device)
            hidden = self._whole_sequence(hidden[rows].float())
        index = torch.tensor(scored, dtype=torch.long, device=whole.labels.device)
        return self.selector.select_scored(
            torch.tensor(whole.sources, device="cpu"),
            self._replay(weight.shape[0]),
            hidden,
            whole.labels[index].to(self.run.device),
            weight,
        ).to(self.run.device)

    def _share(self, picked: torch.Tensor | None) -> list[int]:
        """The last stage's rows on every rank of the pipeline (collective)."""
        group, size = self.run.groups.backbone.mp, self.job.data.coreset.batch_size
        if dist.get_world_size(group) > 1:
            picked = broadcast_selection(picked, size, group, self._last_rank(), self.run.device)
        return picked.tolist()

    def _chosen(self, whole: MicroBatch, rows: list[int]) -> Callable[..., MicroBatch]:
        """`get(mb, dp)` over the collated pool's `rows`, in micro-batches of the job's size."""
        mb = self.job.micro_batch
        chosen = [whole.select(rows[m : m + mb]) for m in range(0, len(rows), mb)]
        return lambda m, dp: chosen[m]  # noqa: ARG005 - every replica has its own pool

    def _picker(self, whole: MicroBatch, scored: list[int], n: int) -> Callable | None:
        """Look-ahead, last stage: once its program is done, keep what the selection needs
        after the update: the pool, its scored rows, their output-layer inputs and the output
        layer's weight."""
        if not self.run.backbone.post_process:
            return None

        def kept(executor) -> tuple:
            hidden_of = {m - n: h for m, h in executor.last_layer_inputs.items()}
            weight = self.run.backbone.gpt.output_layer.weight.detach().clone()  # its dtype
            return whole, scored, hidden_of, weight

        return kept

    def _replay(self, rows: int):
        """The selection's last-layer replay for this rank's `rows` of the output layer."""
        from megatron_mllm.data.sampler import VocabParallelReplay

        tp = self.job.backbone.tp
        if tp == 1:
            return VocabParallelReplay()
        groups = self.run.groups
        return VocabParallelReplay(groups.backbone.tp, groups.coords.tp * rows, rows * tp)

    def _whole_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's inputs [n, s, h] over the whole sequence: sequence parallelism
        hands each TP rank its slice of s."""
        if not (self.job.plans.sequence_parallel and self.job.backbone.tp > 1):
            return hidden
        group = self.run.groups.backbone.tp
        parts = [torch.empty_like(hidden) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, hidden.contiguous(), group=group)
        return torch.cat(parts, dim=1)
