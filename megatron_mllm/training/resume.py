"""Resume: what a training checkpoint holds beyond the weights and how a run continues from it.

A checkpoint (training/checkpointing.py, torch_dist) holds every part's weights and optimizer
state, the LR scheduler, fp16's loss scale, the arguments, and per-replica objects: each
backbone DP replica's data-loader position (saved by the replica's first rank; every rank of the
replica reads it back) and coreset selector, and every rank's RNG streams (kept only when the
layout is the same)."""

from __future__ import annotations

import argparse

from megatron_mllm.errors import RunStopped
from megatron_mllm.training import checkpointing

LAYOUT_ARGS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size")


def _saved_args(args: argparse.Namespace) -> dict:
    """The run's arguments, minus what differs between ranks or is not an argument."""
    return {k: v for k, v in vars(args).items() if k not in ("rank", "coreset")}


def loader_position_fits(saved_args: dict, args: argparse.Namespace) -> bool:
    """A saved loader position fits only a loader opened the same way: the same data (and
    damaged shards left out), DP size, micro-batch, workers, seed and packing buffer."""
    keys = ("data_parallel_size", "data_path", "micro_batch_size", "num_workers", "seed")
    left_out = saved_args.get("data_left_out", [])  # absent before data accounting
    same = all(saved_args.get(k) == getattr(args, k) for k in keys)
    packing = getattr(args, "packing_buffer_size", None)
    same = same and saved_args.get("packing_buffer_size") == packing
    return same and left_out == getattr(args, "data_left_out", [])


def consumed_samples(args, iteration: int, since: tuple[int, int] = (0, 0)) -> int:
    """Samples read by `iteration` (coreset: every sample of each pool, as the log line says),
    counted on from `since` (a checkpoint's iteration and consumed samples: the batch size of
    the run that wrote it may have been another)."""
    ratio = args.coreset.pool_ratio if getattr(args, "coreset", None) is not None else 1
    start, samples = since
    return samples + int((iteration - start) * args.global_batch_size * ratio)


def _new_run_id() -> str:
    """A fresh run id, rank 0's on every rank (collective)."""
    import uuid

    import torch.distributed as dist

    box = [uuid.uuid4().hex]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checkpoint_parts(run) -> list[tuple]:
    """(module, TP rank, TP size, replica id) of everything an ExecutorRun holds, as
    `checkpointing.save` and `load` take them."""
    plan, c = run.job.backbone, run.groups.coords
    enc_tp = c.tp if run.stage0 else c.enc_tp
    enc_replica = (
        c.dp if run.stage0 else (c.enc_slot + run.groups.slots * (c.dp + plan.dp * c.enc_row))
    )
    parts = [(chunk, c.tp, plan.tp, c.dp) for chunk in run.chunks]
    return parts + [(encoder, enc_tp, run.enc_tp, enc_replica) for encoder in run.encoders]


class Checkpointer:
    """Saves and loads one rank's share of a training run (`run`: an ExecutorRun)."""

    def __init__(self, args, run, full_shapes: dict, scheduler) -> None:
        self.args, self.run, self.full_shapes, self.scheduler = args, run, full_shapes, scheduler
        plan, c = run.job.backbone, run.groups.coords
        self.plan, self.coords = plan, c
        # The coreset selector lives on the last stage's TP ranks (alike); TP rank 0 writes it.
        self.holds_selector = run.coreset is not None and run.backbone.post_process
        # Every rank of a replica holds its loader's state; stage 0's TP rank 0 writes it.
        self.data_copy = c.stage * plan.tp + c.tp
        self.streams = bool(run.data.streams)
        self.lookahead = run.coreset is not None and run.coreset.lookahead
        self.source = None  # a converted model's origin (its LLaVA config), kept when saving
        self.plan_record = None  # the plan a --plan-candidates phase kept, kept when saving
        self.run_id = _new_run_id()  # the lineage of checkpoints; a resumed run keeps its own
        self.consumed_since = (0, 0)  # (iteration, samples) the count goes on from
        self.saved_norm: float | None = None  # the parameters' norm at the last save

    @property
    def parts(self) -> list[tuple]:
        """What the run holds now (plan candidates change it): see `checkpoint_parts`."""
        return checkpoint_parts(self.run)

    def _objects(self, saving: bool) -> dict:
        """name -> (state or None, index, count) of the per-replica and per-rank objects."""
        run, c, plan = self.run, self.coords, self.plan
        rng = checkpointing.capture_rng_state() if saving else None
        out = {"rng_state": (rng, self.args.rank, self.args.world_size)}
        if self.holds_selector:
            state = run.coreset.selector.state_dict() if saving else None
            out["coreset_selector"] = (state, c.dp, plan.dp, c.tp)
        if self.streams:
            state = run.data.state(c.dp) if saving else None
            out["data_loader"] = (state, c.dp, plan.dp, self.data_copy)
        if self.lookahead:  # the rows chosen for the next step (its pool is read again)
            if saving:
                run.coreset.settle()  # every rank holds them (collective)
            state = list(run.coreset.pending) if saving else None
            out["coreset_lookahead"] = (state, c.dp, plan.dp, self.data_copy)
        return out

    def consumed(self, iteration: int) -> int:
        """Samples consumed by `iteration`, carried on from the loaded checkpoint's count."""
        return consumed_samples(self.args, iteration, self.consumed_since)

    def latest_saved(self) -> str:
        """Where the run's last finished checkpoint is, in words."""
        held = checkpointing.tracked(self.args.save) if self.args.save else None
        if held is None:
            return "no checkpoint was saved"
        return f"the latest checkpoint stays iteration {held} in {self.args.save}"

    def reference_norm(self) -> None:
        """Before the first save of a run that loaded no norm: the norm to compare with is the
        starting parameters' (collective)."""
        if self.saved_norm is None:
            self.saved_norm = self._norm()[0]

    def _norm(self) -> tuple[float, bool]:
        """The norm of every rank's parameters (replicas counted each time, as in every save)
        and whether all of them are finite (collective)."""
        import math

        import torch
        import torch.distributed as dist

        acc = torch.zeros(2, dtype=torch.float64, device=self.run.device)
        for module, *_ in self.parts:
            for p in module.parameters() if module is not None else ():
                acc[0] += (~torch.isfinite(p)).any()
                acc[1] += p.detach().double().pow(2).sum()
        dist.all_reduce(acc)
        return math.sqrt(float(acc[1])) if not acc[0] else float("nan"), not bool(acc[0])

    def save(self, iteration: int) -> bool:
        """Save iteration `iteration`; RunStopped where a parameter is NaN or Inf, and False
        (not saved, said in one line) where the parameters' norm grew more than
        --max-param-norm-growth times since the last save (finite but exploded)."""
        norm, finite = self._norm()
        if not finite:
            raise RunStopped(
                f"parameters hold NaN or Inf at iteration {iteration}: not saved; "
                f"{self.latest_saved()}"
            )
        bound = self.args.max_param_norm_growth
        if bound and self.saved_norm and norm > bound * self.saved_norm:
            if self.args.rank == 0:
                print(
                    f" > save at iteration {iteration} not taken: the parameters' norm "
                    f"{norm:.3g} is over {bound:g} x the last saved one ({self.saved_norm:.3g}; "
                    f"--max-param-norm-growth); {self.latest_saved()}",
                    flush=True,
                )
            return False
        self._write(iteration, norm)
        self.saved_norm = norm
        return True

    def _write(self, iteration: int, norm: float) -> None:
        args, grad_scaler = self.args, self.run.grad_scaler
        from megatron_mllm.runtime.assembly.optimizer import grad_scaler_state

        common = {
            "iteration": iteration,
            "param_norm": norm,
            "scheduler": self.scheduler.state_dict(),
            "grad_scaler": grad_scaler_state(grad_scaler) if grad_scaler is not None else None,
            "consumed_samples": self.consumed(iteration),
            "args": _saved_args(args),
            "run_id": self.run_id,
        }
        if self.source is not None:
            common["source"] = self.source
        if args.tokenizer_model:
            from megatron_mllm.data.tokenizer import tokenizer_identity

            common["tokenizer"] = tokenizer_identity(args.tokenizer_model, args.image_token)
        record = self.run.checkpoint_record() if hasattr(self.run, "checkpoint_record") else None
        if record is not None or self.plan_record is not None:  # --plan-candidates' kept plan
            common["plan_candidates"] = record or self.plan_record
        checkpointing.save(
            args.save,
            iteration,
            self.parts,
            self.full_shapes,
            self.run.optimizer,
            common,
            self._objects(saving=True),
        )

    def load(self) -> tuple[int, str]:
        """Load `args.load`; returns (the iteration to continue from, what was loaded)."""
        args, run = self.args, self.run
        saved = checkpointing.read_common(args.load)
        saved_args = saved.get("args", {})
        self.source = saved.get("source")
        self.plan_record = saved.get("plan_candidates")
        objects = self._objects(saving=False)
        same_layout = all(saved_args.get(k) == getattr(args, k) for k in LAYOUT_ARGS)
        if not same_layout:  # resharded: RNG streams belong to ranks that no longer exist
            objects.pop("rng_state")
        same_data = loader_position_fits(saved_args, args)
        if not same_data:  # loader positions belong to other DP ranks (or other data)
            objects.pop("data_loader", None)
        pools = ("coreset_pool_ratio", "global_batch_size")
        same_pools = all(saved_args.get(k) == getattr(args, k) for k in pools)
        if not (same_data and same_pools and saved_args.get("coreset_lookahead")):
            objects.pop("coreset_lookahead", None)  # none saved, or for other pools
        common = checkpointing.load(args.load, self.parts, self.full_shapes, run.optimizer, objects)
        if saved.get("model_only"):
            return 0, "model weights only (no optimizer, scheduler or RNG state)"
        self.run_id = saved.get("run_id") or self.run_id
        self.saved_norm = common.get("param_norm")
        it = common["iteration"]
        self.consumed_since = (it, common.get("consumed_samples", consumed_samples(args, it)))
        loaded = common["objects"]
        if self.holds_selector:
            run.coreset.selector.load_state_dict(loaded["coreset_selector"])
        if "rng_state" in loaded:
            checkpointing.restore_rng_state(loaded["rng_state"])
        if "data_loader" in loaded:
            run.data.restore(self.coords.dp, loaded["data_loader"])
        if "coreset_lookahead" in loaded:
            step, rows = loaded["coreset_lookahead"]
            run.coreset.pending = (step, list(rows))
        self.scheduler.load_state_dict(common["scheduler"])
        grad_scaler = run.grad_scaler
        if grad_scaler is not None and common.get("grad_scaler") is not None:
            from megatron_mllm.runtime.assembly.optimizer import load_grad_scaler_state

            load_grad_scaler_state(grad_scaler, common["grad_scaler"])  # fp16: the loss scale
        what = f"iteration {common['iteration']}"
        what += "" if same_layout else ", resharded; fresh RNG"
        if self.streams and not same_data:
            what += (
                "; the data loader starts anew (other DP size, data, damaged shards, micro-batch, "
                "workers or seed)"
            )
        return common["iteration"], what
