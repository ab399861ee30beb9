"""One rank's life for a runtime job: process groups, modules, weights, program, steps.

Modes:
* "executor": our executor runs `job.schedule` (any validated schedule of the tiny MLLM);
* "megatron_core": megatron-core's own forward_backward_pipelining_without_interleaving with
  the encoder in stage 0's forward step (the baseline users have today);
* "reference": one process, no parallelism, every micro-batch in turn.
All load the same canonical weights (`full_state`), so losses and gradients can be compared.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.job import RuntimeJob, check_job, encoder_plan_of, layer_overrides


def _init_rank(rank: int, world: int, seed: int, timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    # megatron-core 0.16.1 still calls these torch names (sequence parallelism)
    warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor)")
    import megatron_mllm_patches

    megatron_mllm_patches.apply_cpu_patches()
    megatron_mllm_patches.apply_runtime_patches()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():  # one GPU per rank; torchrun's LOCAL_RANK when there is one
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    from megatron.core import parallel_state

    parallel_state._set_global_memory_buffer()  # attention's scratch buffer, not parallel state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, tp_rank=0)


def run_rank(rank: int, world: int, job: RuntimeJob) -> dict:
    """Entry point of one rank (see `launch.spawn`)."""
    check_job(job, world)
    _init_rank(rank, world, job.seed, job.timeout_s)
    if job.mode == "reference":
        from megatron_mllm.runtime.reference import reference_run

        return reference_run(job)
    import torch.distributed as dist

    run = make_run(rank, world, job)
    for step in range(job.steps):
        run.step(step)
        if job.replan_after is not None and step + 1 == job.replan_after:
            run.replan()
    dist.barrier()
    return run.result()


_DATASETS: dict[str, object] = {}


def _data(job: RuntimeJob, step: int):
    """Micro-batch m of this step for DP replica dp: from `job.data_path` shards if given (read
    once per process), else synthetic."""
    from megatron_mllm.data.synthetic import microbatch

    if job.data_path:
        from megatron_mllm.data.webdataset import ImageCaptionShards

        if job.data_path not in _DATASETS:
            _DATASETS[job.data_path] = ImageCaptionShards(job.data_path)
        shards, cfg, b = _DATASETS[job.data_path], job.cfg, job.micro_batch

        def from_disk(mb: int, dp: int = 0):
            first = ((step * job.backbone.dp + dp) * job.num_microbatches + mb) * b
            return shards.batch(
                list(range(first, first + b)),
                cfg.image_size,
                cfg.channels,
                cfg.text_len,
                cfg.vocab_size,
            )

        return from_disk

    def get(mb: int, dp: int = 0):
        index = (step * job.backbone.dp + dp) * job.num_microbatches + mb
        return microbatch(job.cfg, index, job.micro_batch, job.seed)

    return get


class ExecutorRun:
    """Our executor on one job: built once, then `step()` as often as wanted."""

    def __init__(self, rank: int, world: int, job: RuntimeJob) -> None:
        from megatron_mllm.models.stages import BackboneStage, EncoderStage
        from megatron_mllm.models.weights import load_full_state
        from megatron_mllm.parallel.groups import build_colocated_groups
        from megatron_mllm.runtime.optimizer import build_optimizer
        from megatron_mllm.runtime.program import gpu_program

        self.rank, self.job = rank, job
        plan = job.backbone
        enc_plan, self.stage0 = encoder_plan_of(job.schedule, plan)
        groups = build_colocated_groups(plan, plan if self.stage0 else enc_plan, world, rank)
        self.groups, c = groups, groups.coords
        vpp = job.schedule.meta.vpp
        overrides = layer_overrides(job.schedule.meta.backbone_layers, plan.pp)
        if vpp > 1:  # megatron-core spreads the layers evenly over the virtual stages
            overrides = {"virtual_pipeline_model_parallel_size": vpp}
        # One module per model chunk (virtual stage) of this rank; self.backbone: the last.
        self.chunks = [
            BackboneStage(
                job.cfg,
                c.stage == 0 and v == 0,
                c.stage == plan.pp - 1 and v == vpp - 1,
                groups.backbone,
                plan.tp,
                plan.pp,
                vp_stage=v if vpp > 1 else None,
                sequence_parallel=job.sequence_parallel,
                **overrides,
            )
            for v in range(vpp)
        ]
        for chunk in self.chunks:
            load_full_state(chunk, job.full_state, c.tp, plan.tp)
        self.backbone = self.chunks[-1]
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        # This rank's stage of every encoder (all share the encoder plan); self.encoder: the first.
        kernels = job.encoder_units == "kernel"
        self.encoders: list[EncoderStage | None] = [None] * job.cfg.num_encoders
        for e in range(job.cfg.num_encoders):
            if self.stage0 and c.stage == 0:
                pg, stage, stages, tp, tp_rank = groups.stage0_encoder(), 0, 1, plan.tp, c.tp
            elif not self.stage0:
                pg, stage, stages = groups.encoder, c.enc_stage, enc_plan.pp
                tp, tp_rank = enc_plan.tp, c.enc_tp
            else:
                continue
            self.encoders[e] = EncoderStage(job.cfg, stage, stages, pg, tp, kernels, index=e)
            load_full_state(self.encoders[e], job.full_state, tp_rank, tp)
            if job.frozen_encoder:
                self.encoders[e].freeze()
        self.encoder = self.encoders[0]
        for module in (*self.chunks, *self.encoders):
            if module is not None:
                module.to(device)  # built on the CPU (use_cpu_initialization), run on the GPU
        self.enc_tp = plan.tp if self.stage0 else enc_plan.tp
        self.program = gpu_program(job.schedule, groups, self.enc_tp)
        self.ordered = self.pool_ordered = None
        if job.ordered_p2p or dist.get_backend() == "nccl":
            self._ordered_p2p(plan, plan if self.stage0 else enc_plan)
        if job.fail_rank == rank:
            self.program = self.program[: job.fail_at_op]
        self.enc_dp_group = groups.backbone.dp if self.stage0 else groups.encoder.dp
        self.optimizer = (
            build_optimizer([*self.chunks, *self.encoders], job.lr) if job.lr > 0 else None
        )
        # Clipping norm: each part once, summed over its own plan's model-parallel group.
        enc_groups = (
            (groups.backbone.mp, groups.backbone.tp)
            if self.stage0
            else (groups.encoder.mp, groups.encoder.tp)
        )
        self.parts = [
            *((chunk, groups.backbone.mp, groups.backbone.tp) for chunk in self.chunks),
            *((encoder, *enc_groups) for encoder in self.encoders),
        ]
        self.history, self.seconds, self.grads, self.spans = [], [], None, []
        self.unit_times: dict[tuple[str, str, str], list[float]] = {}
        self.replanned = None  # (schedule, workload, measured times) once re-planned
        self.selector = None
        if job.coreset is not None:
            from megatron_mllm.data.coreset import CoresetSelector

            self.pool_program = forward_only_program(
                gpu_program(job.pool_schedule, groups, self.enc_tp)
            )
            self.selector = CoresetSelector(job.coreset)

    def _ordered_p2p(self, plan: ParallelPlan, enc_plan: ParallelPlan) -> None:
        """Receive orders and one process group per message direction (see Executor)."""
        from megatron_mllm.runtime.program import all_programs, message_pairs, receive_orders

        job = self.job
        main = all_programs(job.schedule, plan, enc_plan, self.enc_tp)
        pool = {}
        if job.coreset is not None:
            pool = all_programs(job.pool_schedule, plan, enc_plan, self.enc_tp)
            pool = {r: forward_only_program(p) for r, p in pool.items()}
        # new_group is collective: every rank creates every pair's group, in the same order.
        groups = {pair: dist.new_group(list(pair)) for pair in message_pairs(main, pool)}
        self.ordered = (receive_orders(main, self.rank), groups)
        self.pool_ordered = (receive_orders(pool, self.rank), groups)

    def replan(self) -> bool:
        """Online re-planning (collective: every rank calls it): plan Optimus again from every
        rank's measured unit times and run the new schedule from the next step. False where
        the schedule keeps the encoder on stage 0 or the new plan needs other modules."""
        from dataclasses import replace

        from megatron_mllm.runtime.program import gpu_program
        from megatron_mllm.runtime.replan import replan

        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.unit_times)
        job = self.job
        enc_plan, stage0 = encoder_plan_of(job.schedule, job.backbone)
        if stage0:
            return False
        out = replan(
            job.cfg,
            job.backbone,
            job.micro_batch,
            job.num_microbatches,
            job.schedule,
            enc_plan,
            gathered,
            job.encoder_units,
            job.frozen_encoder,
            job.sequence_parallel,
        )
        if out is None:
            return False
        new_job = replace(job, schedule=out[0])
        check_job(new_job, dist.get_world_size())
        self.job, self.replanned = new_job, out
        self.program = gpu_program(out[0], self.groups, self.enc_tp)
        if self.ordered is not None:
            self._ordered_p2p(job.backbone, enc_plan)
        return True

    def select(self, step: int) -> list[int]:
        """Coreset: the pool's forward pass without gradients through the whole pipeline; the
        last stage computes features on its output layer and selects; every rank of the
        pipeline gets the chosen sample ids."""
        import torch.distributed as dist

        from megatron_mllm.data.sampler import broadcast_selection
        from megatron_mllm.data.synthetic import samples
        from megatron_mllm.parallel.groups import backbone_rank
        from megatron_mllm.runtime.executor import Executor

        job, c, mb = self.job, self.groups.coords, self.job.micro_batch
        size = job.coreset.pool_size
        ids = [(step * job.backbone.dp + c.dp) * size + j for j in range(size)]
        executor = Executor(
            self.pool_program,
            job.pool_schedule.meta,
            job.cfg,
            self.rank,
            self.chunks,
            self.encoders,
            lambda m: samples(job.cfg, ids[m * mb : (m + 1) * mb], job.seed)[:2],
            mb,
            self.groups.backbone.dp,
            self.enc_dp_group,
            job.backbone.dp,
            job.timeout_s,
            forward_only=True,
            ordered=self.pool_ordered,
        )
        executor.run_step()
        chosen = None
        if self.backbone.post_process:
            hidden = torch.cat([executor.last_layer_inputs[m] for m in range(size // mb)])
            _, text, source = samples(job.cfg, ids, job.seed)
            from megatron_mllm.data.sampler import caption_replay_loss

            picked = self.selector.select(
                source,
                caption_replay_loss(job.cfg.image_tokens),
                hidden,
                text,
                self.backbone.gpt.output_layer.weight.detach(),
            )
            chosen = torch.tensor(ids)[picked]
        last = backbone_rank(job.backbone, 0, c.dp, job.backbone.pp - 1)
        group = self.groups.backbone.mp
        if dist.get_world_size(group) == 1:
            return chosen.tolist()
        return broadcast_selection(chosen, job.coreset.batch_size, group, last).tolist()

    def step(self, step: int) -> None:
        from megatron_mllm.models.weights import grad_shards
        from megatron_mllm.runtime.executor import Executor
        from megatron_mllm.runtime.optimizer import (
            allreduce_sequence_parallel_grads,
            clip_by_global_norm,
        )

        job, c = self.job, self.groups.coords
        for module in (*self.chunks, *self.encoders):
            for p in module.parameters() if module is not None else ():
                p.grad = None
        data = _data(job, step)
        if self.selector is not None:
            from megatron_mllm.data.synthetic import samples

            chosen, mb = self.select(step), job.micro_batch

            def data(m, dp, chosen=chosen):  # noqa: ARG001 - every replica has its own pool
                return samples(job.cfg, chosen[m * mb : (m + 1) * mb], job.seed)[:2]

        executor = Executor(
            self.program,
            job.schedule.meta,
            job.cfg,
            self.rank,
            self.chunks,
            self.encoders,
            lambda m: data(m, c.dp),
            job.micro_batch,
            self.groups.backbone.dp,
            self.enc_dp_group,
            job.backbone.dp,
            job.timeout_s,
            dynamic=job.dynamic,
            ordered=self.ordered,
            overlap_fills=job.overlap_tp_fills and self.enc_tp == 1,
        )
        if job.fail_rank == self.rank:
            executor.run_step()
            os._exit(3)  # die mid-step, as a crashed rank would
        result = executor.run_step()
        allreduce_sequence_parallel_grads(self.chunks, self.groups.backbone.tp)
        for key, values in result.unit_times.items():
            self.unit_times.setdefault(key, []).extend(values)
        self.seconds.append(result.seconds)
        self.spans = result.spans
        self.moved = result.moved
        self.overlapped, self.overlapped_in = result.overlapped, result.overlapped_in
        self.history.append({(c.dp, m): v for m, v in result.losses.items()})
        if job.collect_grads and step == 0:
            self.grads = {k: v for m in self.chunks for k, v in grad_shards(m, c.tp).items()}
            if self.encoder is not None and (
                self.stage0 or (c.enc_slot, c.enc_row, c.dp) == (0, 0, 0)
            ):
                for encoder in self.encoders:
                    self.grads.update(grad_shards(encoder, c.enc_tp if not self.stage0 else c.tp))
        clip = job.clip_grad if self.optimizer is not None else 0.0
        self.last_grad_norm = clip_by_global_norm(self.parts, clip)
        if self.optimizer is not None:
            self.optimizer.step()

    def _replan_predicted_s(self) -> float | None:
        """The simulator's step time for the re-planned schedule under the measured times."""
        if self.replanned is None:
            return None
        from megatron_mllm.schedule.simulator import simulate

        return simulate(self.replanned[0], self.replanned[1]).step_time_s

    def result(self) -> dict:
        out = {
            "replanned": self.replanned is not None,
            "replan_times": self.replanned[2] if self.replanned is not None else None,
            "replan_predicted_s": self._replan_predicted_s(),
            "moved": getattr(self, "moved", 0),
            "overlapped": getattr(self, "overlapped", 0),
            "overlapped_in": getattr(self, "overlapped_in", {}),
            "losses": self.history[0],
            "history": self.history,
            "spans": self.spans,
            "seconds": self.seconds,
            "unit_times": self.unit_times,  # every step's measured unit and collective times
            "coords": self.groups.coords,
        }
        if self.job.collect_grads:
            out["grads"] = self.grads
        if self.job.collect_params:
            from megatron_mllm.models.weights import param_shards

            c = self.groups.coords
            out["params"] = {k: v for m in self.chunks for k, v in param_shards(m, c.tp).items()}
            enc_tp = c.tp if self.stage0 else c.enc_tp
            for encoder in (e for e in self.encoders if e is not None):
                out["params"].update(param_shards(encoder, enc_tp))
        return out


def forward_only_program(program):
    """The forward half of a GPU program (a coreset pool pass): F and EF, and the messages that
    carry activations forward."""
    keep = ("act", "eout", "eact")
    out = []
    for op in program:
        if op.kind == "run" and op.action.kind in ("F", "EF"):
            from dataclasses import replace

            out.append(replace(op, fills=tuple(f for f in op.fills if f.kind == "EF")))
        elif op.kind == "run" and op.fills:
            from dataclasses import replace

            out += [replace(op, action=f, fills=()) for f in op.fills if f.kind == "EF"]
        elif op.kind in ("send", "recv") and op.key.split(".")[0] in keep:
            out.append(op)
    return out


def make_run(rank: int, world: int, job: RuntimeJob):
    """A built executor or megatron-core run for `job` (after `_init_rank`)."""
    if job.mode == "megatron_core":
        from megatron_mllm.runtime.megatron_baseline import MegatronCoreRun

        return MegatronCoreRun(rank, job)
    return ExecutorRun(rank, world, job)


def run_interleaved(rank: int, world: int, jobs: list[RuntimeJob], steps: int) -> list[dict]:
    """Several jobs in the same processes, taking steps in turn (A B C A B C ...): the fairest
    comparison on a noisy machine. Returns each job's result."""
    import torch.distributed as dist

    for job in jobs:
        check_job(job, world)
    _init_rank(rank, world, jobs[0].seed, jobs[0].timeout_s)
    runs = [make_run(rank, world, job) for job in jobs]
    for step in range(steps):
        for job, run in zip(jobs, runs, strict=True):
            run.step(step)
            if job.replan_after is not None and step + 1 == job.replan_after:
                run.replan()
    dist.barrier()
    return [run.result() for run in runs]
