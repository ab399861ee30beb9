"""Runs one GPU's program on real megatron-core modules and torch.distributed.

Handlers, one per action kind (DeepSpeed's instruction -> handler map): backbone forward and
backward, encoder units forward and backward, tagged asynchronous p2p (never relying on the order
in which two messages between the same pair of ranks were posted), gradient reduction over each
plan's own DP group. What really ran is recorded as trace spans in the simulator's format.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.models.stages import BackboneStage, EncoderStage
from megatron_mllm.runtime.program import Op
from megatron_mllm.schedule.actions import Action
from megatron_mllm.schedule.schedule import ScheduleMeta
from megatron_mllm.schedule.simulator import Span


class PeerFailure(RuntimeError):
    """A message did not arrive: names this rank, the action waited on and the peer."""


@dataclass
class StepResult:
    losses: dict[int, float] = field(default_factory=dict)  # micro-batch -> loss (last stage)
    spans: list[Span] = field(default_factory=list)
    seconds: float = 0.0
    moved: int = 0  # dynamic mode: encoder chunks run ahead of their place in the program
    overlapped: int = 0  # fills run while a backbone TP collective was in flight
    overlapped_in: dict[str, int] = field(default_factory=dict)  # ... per collective kind
    # Measured seconds for re-planning: (model, "forward"|"backward", unit name) -> samples;
    # the backbone's per layer (a chunk's F or B compute time over its layer count) and per TP
    # collective: ("llm", "collectives", "all_reduce" | "all_gather" | "reduce_scatter" [+ "_b"]).
    unit_times: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)


class Executor:
    """Executes `program` (from `gpu_program`) once per training step."""

    def __init__(
        self,
        program: list[Op],
        meta: ScheduleMeta,
        cfg: MLLMConfig,
        rank: int,
        backbone: list[BackboneStage],
        encoder: EncoderStage | None,
        data: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        micro_batch: int,
        backbone_dp_group,
        encoder_dp_group,
        backbone_dp: int,
        timeout_s: float = 60.0,
        forward_only: bool = False,
        dynamic: bool = False,
        ordered: tuple[dict, dict] | None = None,
        overlap_fills: bool = False,
    ) -> None:
        self.program, self.meta, self.cfg, self.rank = program, meta, cfg, rank
        # One module per virtual stage (model chunk) this rank holds; the last holds the loss.
        self.chunks = backbone
        # This GPU's stage of each encoder (None where it holds none), indexed by encoder.
        self.encoders = encoder if isinstance(encoder, list) else [encoder]
        self.backbone = backbone[-1]
        self.device = next(self.backbone.parameters()).device  # buffers and batches go here
        # A frozen encoder trains its projector only: no gradient flows into its layers.
        self.encoder_frozen = [
            enc is not None
            and not any(
                p.requires_grad for n, p in enc.named_parameters() if not n.startswith("projector")
            )
            for enc in self.encoders
        ]
        self.data, self.micro_batch = data, micro_batch
        self.bb_dp_group, self.enc_dp_group, self.bb_dp = (
            backbone_dp_group,
            encoder_dp_group,
            backbone_dp,
        )
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # Forward-only (a coreset pool): no graph; the last stage keeps its output layer's input.
        self.forward_only = forward_only
        # Dynamic mode: run ready encoder work while waiting for a message (see _fill_wait).
        self.dynamic = dynamic
        # Ordered mode (NCCL has no tags): (receive orders {src: keys in the sender's posting
        # order}, {(src, dst): a process group carrying only that direction}). Every receive is
        # posted at step start in its sender's order, so matching by order is matching by key,
        # and no send waits behind a receive on a shared stream.
        self.ordered = ordered
        # Overlap: a backbone action's TP-bubble fills run while its TP all-reduces are in
        # flight (patches/async_tp_collectives.py); what is left runs right after it.
        self.overlap_fills = overlap_fills
        self._fill_s = 0.0  # seconds spent in fills nested inside backbone actions
        self.last_layer_inputs: dict[int, torch.Tensor] = {}
        self.handlers = {
            "F": self._forward,
            "B": self._backward,
            "EF": self._encoder_forward,
            "EB": self._encoder_backward,
            "AG": self._all_gather,
            "RS": self._reduce_scatter,
        }

    # -- one step ------------------------------------------------------------------------------
    def run_step(self) -> StepResult:
        self.tensors: dict[str, torch.Tensor] = {}
        self.bb_ctx: dict[tuple, tuple] = {}
        self.enc_units: dict[tuple, list] = {}
        self.pending: list = []
        self.reductions: list[Callable[[], None]] = []  # gradient all-reduces still in flight
        self.result = StepResult()
        self._batches: dict[int, tuple] = {}
        self._bwd_done: dict[tuple, int] = {}  # encoder backward units done per (e, s, mb)
        t0 = time.perf_counter()
        self.posted: dict[tuple[str, int], tuple] = {}
        if self.ordered is not None:
            orders, groups = self.ordered
            for src, keys in orders.items():
                for key in keys:
                    buf = torch.empty(self._shape(key), device=self.device)
                    work = dist.irecv(buf, src, group=groups[(src, self.rank)], tag=0)
                    self.posted[(key, src)] = (work, buf)
        hook = None
        if self.forward_only and self.backbone.post_process:
            self._captured: list[torch.Tensor] = []

            def capture(module, args):
                self._captured.append(args[0].transpose(0, 1).detach())  # [b, s, h]

            hook = self.backbone.gpt.output_layer.register_forward_pre_hook(capture)
        try:
            with torch.no_grad() if self.forward_only else contextlib.nullcontext():
                self._run_program(t0)
        finally:
            if hook is not None:
                hook.remove()
        for work, op in self.pending:
            self._wait(work, op)
        for finish in self.reductions:
            finish()
        self.result.seconds = time.perf_counter() - t0
        return self.result

    def _run_program(self, t0: float) -> None:
        done = [False] * len(self.program)
        for i, op in enumerate(self.program):
            if done[i]:
                continue
            start = time.perf_counter() - t0
            if op.kind == "run":
                if op.fills and self.overlap_fills:
                    self._run_overlapped(op, t0)
                else:  # sequential: the fills just before their backbone action
                    for fill in op.fills:
                        self._run(fill, t0)
                    self._run(op.action, t0)
                continue
            if op.kind == "send":
                tensor = self.tensors[op.key].contiguous()
                if self.ordered is not None:
                    group = self.ordered[1][(self.rank, op.peer)]
                    work = dist.isend(tensor, op.peer, group=group, tag=0)
                else:
                    work = dist.isend(tensor, op.peer, tag=op.tag)
                self.pending.append((work, op))
            else:
                if self.ordered is not None:
                    work, buf = self.posted.pop((op.key, op.peer))
                else:
                    buf = torch.empty(self._shape(op.key), device=self.device)
                    work = dist.irecv(buf, op.peer, tag=op.tag)
                if self.dynamic:
                    self._fill_wait(work, i, done, t0)
                self._wait(work, op)
                self.tensors[op.key] = buf
            end = time.perf_counter() - t0
            self.result.spans.append(
                Span(
                    self.rank,
                    None,
                    "p2p",
                    Action(op.kind.upper(), key=op.key),
                    "",
                    start,
                    end,
                    "p2p",
                )
            )

    def _run_overlapped(self, op: Op, t0: float) -> None:
        from megatron_mllm_patches.async_tp_collectives import filling

        queue = list(op.fills)

        def fill(kind: str) -> bool:
            if not queue:
                return False
            start = time.perf_counter()
            # A wait inside the backbone's backward runs under autograd's no-grad mode; an
            # encoder forward fill still builds its graph (and a backward fill re-enters).
            with torch.set_grad_enabled(not self.forward_only):
                self._run(queue.pop(0), t0)
            self._fill_s += time.perf_counter() - start
            self.result.overlapped += 1
            inside = self.result.overlapped_in
            inside[kind] = inside.get(kind, 0) + 1
            return True

        with filling(fill):
            self._run(op.action, t0)
        for rest in queue:
            self._run(rest, t0)

    def _fill_wait(self, work, i: int, done: list[bool], t0: float) -> None:
        """Dynamic mode: while a message is on its way, run later encoder work that is ready."""
        lookahead = 64
        while not work.is_completed():
            for j in range(i + 1, min(i + 1 + lookahead, len(self.program))):
                op = self.program[j]
                if (
                    not done[j]
                    and op.kind == "run"
                    and op.action.kind in ("EF", "EB")
                    and not op.fills
                    and self._ready(op.action)
                ):
                    self._run(op.action, t0)
                    done[j] = True
                    self.result.moved += 1
                    break
            else:
                return  # nothing ready: block on the message

    def _ready(self, a: Action) -> bool:
        """Whether an encoder chunk's inputs are already on this GPU."""
        enc = self.meta.encoders[a.enc]
        units = self.enc_units.get((a.enc, a.stage, a.mb), [])
        if a.kind == "EF":
            if a.k0 > 0:
                return len(units) == a.k0
            return a.stage == 0 or f"eact.e{a.enc}.s{a.stage}.m{a.mb}" in self.tensors
        if (
            len(units) != enc.fwd_kernels[a.stage]
            or self._bwd_done.get((a.enc, a.stage, a.mb), 0) != a.k0
        ):
            return False
        if a.k0 > 0:
            return True
        last = a.stage == enc.num_stages - 1
        key = f"egrad.e{a.enc}.m{a.mb}" if last else f"egin.e{a.enc}.s{a.stage}.m{a.mb}"
        return key in self.tensors

    def _time(self, model: str, direction: str, name: str, seconds: float) -> None:
        self.result.unit_times.setdefault((model, direction, name), []).append(seconds)

    def _run(self, action: Action, t0: float) -> None:
        start, nested = time.perf_counter() - t0, self._fill_s
        if action.kind in ("F", "B"):
            from megatron_mllm_patches.async_tp_collectives import observing

            forward, blocked = action.kind == "F", []

            def observe(kind: str, seconds: float, filled: bool) -> None:
                blocked.append(seconds)
                if not filled:  # a clean sample of what the collective costs the action
                    self._time("llm", "collectives", kind + ("" if forward else "_b"), seconds)

            with observing(observe):
                self.handlers[action.kind](action)
        else:
            self.handlers[action.kind](action)
        end = time.perf_counter() - t0
        if action.kind in ("F", "B"):
            layers = len(self.chunks[action.chunk].gpt.decoder.layers)
            name = "layer" if forward else "layer_b"
            # Compute only: without fills run inside it and without time blocked in collectives
            # (measured separately, above).
            own = end - start - (self._fill_s - nested) - sum(blocked)
            self._time("llm", "forward" if forward else "backward", name, own / layers)
        category = {"F": "backbone", "B": "backbone", "EF": "encoder", "EB": "encoder"}.get(
            action.kind, "dp"
        )
        stream = "dp" if category == "dp" else "compute"
        self.result.spans.append(Span(self.rank, None, stream, action, "", start, end, category))

    def _wait(self, work, op: Op) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as err:
            raise PeerFailure(
                f"rank {self.rank}: {op} failed while waiting on rank {op.peer}: "
                f"{str(err).splitlines()[0]}"
            ) from None
        if ok is False:
            raise PeerFailure(
                f"rank {self.rank}: timed out after {self.timeout.total_seconds():.0f}"
                f" s waiting on {op} (rank {op.peer})"
            )

    def _shape(self, key: str) -> tuple[int, ...]:
        cfg, b = self.cfg, self.micro_batch
        prefix = key.split(".", 1)[0]
        if prefix in ("act", "grad"):  # [s/tp, b, h] with sequence parallelism
            config = self.backbone.gpt.config
            split = config.tensor_model_parallel_size if config.sequence_parallel else 1
            return (cfg.seq_len // split, b, cfg.llm_hidden)
        enc = cfg.encoder_config(int(key.split(".")[1][1:]))  # keys name their encoder: e{e}
        if prefix in ("eout", "egrad"):
            return (enc.num_patches, b, cfg.llm_hidden)
        return (enc.encoder_seq_len, b, enc.vit_hidden)

    def _batch(self, mb: int):
        if mb not in self._batches:
            self._batches[mb] = tuple(t.to(self.device) for t in self.data(mb))
        return self._batches[mb]

    # -- backbone --------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        meta = self.meta
        v = meta.virtual_index(a.stage, a.chunk)
        last = v == meta.num_virtual_stages - 1
        if v == 0:
            eouts = [
                self.tensors[f"eout.e{e}.m{a.mb}"].detach().requires_grad_()
                for e in range(len(meta.encoders))
            ]
            _, text = self._batch(a.mb)
            inputs = eouts
            first = self.chunks[a.chunk]
            out = first(None, first.decoder_input(eouts, text))
        else:
            x = self.tensors.pop(f"act.s{a.stage}v{a.chunk}.m{a.mb}").detach().requires_grad_()
            inputs = [x]
            out = self.chunks[a.chunk](x)
        if last and self.forward_only:
            self.last_layer_inputs[a.mb] = self._captured.pop()
        elif last:
            _, text = self._batch(a.mb)
            out = self.backbone.loss(out, text)
            self.result.losses[a.mb] = out.item()
        else:
            s, c = meta.stage_chunk(v + 1)
            self.tensors[f"act.s{s}v{c}.m{a.mb}"] = out.detach()
        self.bb_ctx[(a.stage, a.chunk, a.mb)] = (inputs, out)

    def _backward(self, a: Action) -> None:
        meta = self.meta
        v = meta.virtual_index(a.stage, a.chunk)
        inputs, out = self.bb_ctx.pop((a.stage, a.chunk, a.mb))
        if v == meta.num_virtual_stages - 1:
            (out / meta.num_microbatches).backward()
        else:
            out.backward(self.tensors.pop(f"grad.s{a.stage}v{a.chunk}.m{a.mb}"))
        if v > 0:
            s, c = meta.stage_chunk(v - 1)
            self.tensors[f"grad.s{s}v{c}.m{a.mb}"] = inputs[0].grad
        else:
            for e, x in enumerate(inputs):
                if meta.encoders[e].trainable:
                    self.tensors[f"egrad.e{e}.m{a.mb}"] = x.grad

    # -- encoder ---------------------------------------------------------------------------
    def _encoder_forward(self, a: Action) -> None:
        """Units k0..k1 of an encoder stage; each keeps its input leaves and output state, so
        its backward can run on its own (see EncoderStage's units)."""
        enc_meta = self.meta.encoders[a.enc]
        units = self.enc_units.setdefault((a.enc, a.stage, a.mb), [])
        if a.k0 == 0:
            first = (
                self._batch(a.mb)[0]
                if a.stage == 0
                else self.tensors.pop(f"eact.e{a.enc}.s{a.stage}.m{a.mb}")
            )
            state = (first,)
        else:
            state = units[-1][1]
        encoder, model = self.encoders[a.enc], self.cfg.encoder_name(a.enc)
        names, t_unit = encoder.unit_names(), time.perf_counter()
        for u in range(a.k0, a.k1):
            if encoder.unit_trainable(u):
                upstream = not (a.stage == 0 and u == 0) and not self.encoder_frozen[a.enc]
                leaves = tuple(t.detach().requires_grad_(upstream) for t in state)
                out = encoder.run_unit(u, leaves)
            else:  # frozen: no graph, and nothing upstream of it wants a gradient
                leaves = tuple(t.detach() for t in state)
                with torch.no_grad():
                    out = encoder.run_unit(u, leaves)
            units.append((leaves, out))
            state = out
            self._time(model, "forward", names[u], time.perf_counter() - t_unit)
            t_unit = time.perf_counter()
        if a.k1 == enc_meta.fwd_kernels[a.stage]:
            last = a.stage == enc_meta.num_stages - 1
            key = f"eout.e{a.enc}.m{a.mb}" if last else f"eact.e{a.enc}.s{a.stage + 1}.m{a.mb}"
            (self.tensors[key],) = (t.detach() for t in state)

    def _encoder_backward(self, a: Action) -> None:
        enc_meta = self.meta.encoders[a.enc]
        units = self.enc_units[(a.enc, a.stage, a.mb)]
        total = enc_meta.fwd_kernels[a.stage]
        last = a.stage == enc_meta.num_stages - 1
        names, model = self.encoders[a.enc].unit_names(), self.cfg.encoder_name(a.enc)
        for b in range(a.k0, a.k1):
            t_unit = time.perf_counter()
            u = total - 1 - b
            if b == 0:
                key = f"egrad.e{a.enc}.m{a.mb}" if last else f"egin.e{a.enc}.s{a.stage}.m{a.mb}"
                grads = (self.tensors.pop(key),)
            else:
                grads = tuple(leaf.grad for leaf in units[u + 1][0])
            outs = [(y, g) for y, g in zip(units[u][1], grads, strict=True) if g is not None]
            torch.autograd.backward([y for y, _ in outs], [g for _, g in outs])
            self._bwd_done[(a.enc, a.stage, a.mb)] = b + 1
            self._time(model, "backward", names[u] + "_b", time.perf_counter() - t_unit)
        if a.k1 == enc_meta.bwd_kernels[a.stage]:
            if a.stage > 0 and enc_meta.bwd_kernels[a.stage - 1] > 0:
                self.tensors[f"egin.e{a.enc}.s{a.stage - 1}.m{a.mb}"] = units[0][0][0].grad
            del self.enc_units[(a.enc, a.stage, a.mb)]

    # -- data parallel ---------------------------------------------------------------------
    def _all_gather(self, a: Action) -> None:
        """Parameters are replicated over DP (non-distributed optimizer): nothing to gather."""

    def _reduce_scatter(self, a: Action) -> None:
        """Average the part's gradients over its own DP group (one flat all-reduce)."""
        modules = self.chunks if a.key == "bb" else [self.encoders[int(a.key[1:])]]
        group = self.bb_dp_group if a.key == "bb" else self.enc_dp_group
        if modules[0] is None or dist.get_world_size(group) == 1 and self.bb_dp == 1:
            return
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        # The encoder's DP group holds m pipelines per backbone replica, each with its own
        # micro-batches: their gradients add up, then average over backbone replicas.
        flat /= self.bb_dp
        i = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[i : i + n].view_as(p))
            i += n
