"""What happens around each training iteration besides the step: when to save, the exit
signal, the non-finite and corrupted-sample checks, validation, and the trace export."""

from __future__ import annotations

import json
import math
import os

from megatron_mllm.errors import RunStopped
from megatron_mllm.training.log import validation_lines


class SavePolicy:
    """When the loop saves: every --save-interval iterations and at the end, except inside the
    plan-candidate phase (the save is taken when the phase ends) and right after iterations
    skipped for NaN or Inf (not taken, said in one line: the latest stays a healthy state)."""

    def __init__(self, args, run, checkpointer) -> None:
        self.args, self.run, self.checkpointer = args, run, checkpointer
        self.deferred: int | None = None  # a save that fell inside the candidate phase
        self.saved_at: int | None = None

    def after(self, iteration: int, nan_run: int, last: bool = False) -> None:
        """After iteration `iteration` (`last`: the run ends there); `nan_run`: iterations
        skipped in a row up to it."""
        args = self.args
        interval = bool(args.save_interval) and iteration % args.save_interval == 0
        if not args.save or self.saved_at == iteration:
            return
        if not (last or interval or self.deferred is not None):
            return
        if getattr(self.run, "kept", 0) is None:  # inside the plan-candidate phase
            self.deferred = self.deferred or iteration
            return
        if nan_run and args.check_for_nan_in_loss_and_grad:  # they were skipped
            self._say(
                f" > save at iteration {iteration} not taken: the last {nan_run} iteration(s) "
                f"had a NaN or Inf loss or gradient norm and were skipped; "
                f"{self.checkpointer.latest_saved()}"
            )
            return
        if self.deferred is not None and self.deferred != iteration:
            self._say(
                f" > the save at iteration {self.deferred} fell inside the plan-candidate "
                f"phase: saved at iteration {iteration}, when it ended"
            )
        if self.checkpointer.save(iteration):
            self.saved_at, self.deferred = iteration, None

    def _say(self, line: str) -> None:
        if self.args.rank == 0:
            print(line, flush=True)


class ExitSignal:
    """--exit-signal-handler: the signal (--exit-signal, default SIGTERM, how clusters pre-empt
    jobs) is noted when it arrives; after each iteration every rank learns whether any rank got
    it (one all-reduce), so all of them save and stop after the same iteration."""

    def __init__(self, name: str) -> None:
        import signal

        self.name, self.got = name, False
        signal.signal(getattr(signal, name), self._note)

    def _note(self, signum, frame) -> None:
        self.got = True

    def received(self, device) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([float(self.got)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def not_finite_step(loss: float, grad_norm: float, fp16: bool) -> bool:
    """A NaN or Inf loss or gradient norm (under fp16 an overflowing norm is the loss scaler's
    business: it backs off and skips, and the step is not counted as NaN)."""
    return not math.isfinite(loss) or (not fp16 and not math.isfinite(grad_norm))


def truncated_samples(run, device) -> tuple[int, int, int, int]:
    """Samples cut to --seq-length so far, those of them left without an answer token,
    samples skipped as corrupted and samples read, over every DP replica (collective: each
    replica's stage-0 TP-rank-0 counts its stream)."""
    import torch
    import torch.distributed as dist

    c = run.groups.coords
    mine = run.data.cut() if (c.tp == 0 and c.stage == 0) else (0, 0, 0, 0)
    total = torch.tensor(mine, dtype=torch.long, device=device)
    dist.all_reduce(total)
    return tuple(int(x) for x in total)


def check_corrupted(args, counts: tuple[int, ...] | None, consumed: int) -> None:
    """Samples skipped as corrupted stay within --max-skipped-samples-fraction of those read."""
    if counts is None or not counts[2]:
        return
    read = consumed + counts[2]  # the skipped ones were read and not trained on
    if counts[2] > args.max_skipped_samples_fraction * read:
        raise RunStopped(
            f"{counts[2]} of {read} samples read so far had members that do not decode "
            f"(named on the ranks' stderr), over --max-skipped-samples-fraction "
            f"{args.max_skipped_samples_fraction}; repair or re-convert the data set"
        )


class Validation:
    """--eval-iters forward-only passes of the training schedule over the validation split
    (its own stream per DP replica, starting over when it ends), Megatron's validation lines,
    and the exact-match accuracy of the assistant turns."""

    def __init__(self, args, run, device) -> None:
        from megatron_mllm.runtime.inputs.batches import StepData

        self.args, self.run, self.device = args, run, device
        self.data = StepData(run.job, [run.groups.coords.dp], split="val")

    def report(self, iteration: int, final: bool = False) -> None:
        """Validate (collective) and print on rank 0."""
        import torch
        import torch.distributed as dist

        total = torch.zeros(4, dtype=torch.float64, device=self.device)
        counts = self.run.groups.coords.tp == 0  # every TP rank of the last stage has them
        per_token = self.run.job.data.per_token_loss  # weigh each micro-batch by its tokens
        for i in range(self.args.eval_iters):
            data = self.data.step(i)
            out = self.run.evaluate(data)
            for mb, loss in out["losses"].items() if counts else ():
                exact, answered = out["matches"][mb]
                weight = data(mb, self.run.groups.coords.dp).labelled_tokens if per_token else 1
                row = [loss * weight, weight, exact, answered]
                total += torch.tensor(row, dtype=torch.float64).to(total)
        dist.all_reduce(total)
        if self.args.rank == 0:
            loss = float(total[0] / total[1].clamp(min=1))
            accuracy = float(total[2] / total[3].clamp(min=1))
            print(validation_lines(iteration, loss, accuracy, int(total[3]), final), flush=True)

    def close(self) -> None:
        self.data.close()


def export_trace(args, spans, world: int, rank: int) -> None:
    """The last step's measured spans of every rank as a Chrome trace and a PNG (rank 0)."""
    import torch.distributed as dist

    from megatron_mllm.schedule.trace import MeasuredTimeline, chrome_trace_events, write_png

    gathered = [None] * world
    dist.all_gather_object(gathered, spans)
    if rank != 0:
        return
    spans = [s for rank_spans in gathered for s in rank_spans]
    os.makedirs(os.path.dirname(args.trace) or ".", exist_ok=True)
    with open(args.trace, "w") as f:
        events = chrome_trace_events(spans, "measured")
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    png = os.path.splitext(args.trace)[0] + ".png"
    title = f"measured step {args.train_iters} ({args.bubble_schedule})"
    write_png({title: MeasuredTimeline(spans)}, png)
    print(f" wrote {args.trace} and {png}", flush=True)
