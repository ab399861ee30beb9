"""Model pieces with their costs: layers, projector and LM head as `Block`s for the stages."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_mllm.schedule.config import MLLMJob
from megatron_mllm.schedule.cost_model import (
    CostModel,
    Kernel,
    model_state_bytes_per_param,
    scaled_kernels,
)


@dataclass
class Block:
    """Contiguous model work on one GPU: forward and backward kernels, activations, params."""

    name: str
    fwd: list[Kernel]
    bwd: list[Kernel]
    act_bytes: float  # kept for backward, per micro-batch
    params: float  # parameters on one GPU
    tags: set[str] = field(default_factory=set)
    trainable_params: float | None = None  # None: all of `params`

    def __post_init__(self) -> None:
        if self.trainable_params is None:
            self.trainable_params = 0.0 if "frozen" in self.tags else self.params


def concat(blocks: list[Block], coalesce: bool) -> Block:
    """Blocks run one after another; backward runs them in reverse."""
    fwd = [k for b in blocks for k in b.fwd]
    bwd = [k for b in reversed(blocks) for k in b.bwd]
    if coalesce:
        fwd, bwd = coalesce_kernels(fwd), coalesce_kernels(bwd)
    return Block(
        "+".join(b.name for b in blocks)
        if len(blocks) < 4
        else f"{blocks[0].name}..{blocks[-1].name}",
        fwd,
        bwd,
        sum(b.act_bytes for b in blocks),
        sum(b.params for b in blocks),
        set().union(*(b.tags for b in blocks)) - {"frozen"} if blocks else set(),
        sum(b.trainable_params for b in blocks),
    )


def coalesce_kernels(kernels: list[Kernel]) -> list[Kernel]:
    """Merge runs of kernels up to each TP collective (same timing, fewer events)."""
    out, acc, wgrad, names = [], 0.0, 0.0, []
    for k in kernels:
        acc += k.compute_s
        wgrad += k.wgrad_s
        names.append(k.name)
        if k.comm_s > 0:
            out.append(Kernel(f"{names[0]}..{names[-1]}", acc, k.comm_s, wgrad))
            acc, wgrad, names = 0.0, 0.0, []
    if names:
        out.append(Kernel(f"{names[0]}..{names[-1]}", acc, 0.0, wgrad))
    return out


class JobCosts:
    """Blocks for one job's models under a cost model.

    `unit` is the granularity of encoder work the schedule may split: "kernel" (norms, GEMMs,
    attention, ... of each layer; for planning) or "layer" (patch embedding, each layer, final
    norm + projector: what the runtime's encoder stages run one at a time).
    """

    def __init__(self, job: MLLMJob, measured: dict | None = None, unit: str = "kernel") -> None:
        if unit not in ("kernel", "layer"):
            raise ValueError(f"unit must be 'kernel' or 'layer', got {unit!r}")
        self.job = job
        self.unit = unit
        self.cm = CostModel(job.hw, job.micro_batch, job.sequence_parallel, measured)

    def _as_unit(self, block: Block, model: str, name: str) -> Block:
        """The block in planning units: one kernel forward and one backward ("layer") or its
        kernels ("kernel"). Where the profile measured the whole unit (`profile_units`) and no
        kernel of it by name, its compute takes the measured seconds, shared in the cost
        model's proportions, and its collectives stay only where measured apart."""
        measured = self.cm.measured.get(model, {})
        keep_comm = "collectives" in measured

        def one(kernels: list[Kernel], direction: str, unit: str) -> list[Kernel]:
            if not kernels:
                return []
            if self.unit == "layer":
                kernels = [
                    Kernel(
                        unit,
                        sum(k.compute_s for k in kernels),
                        sum(k.comm_s for k in kernels),
                        sum(k.wgrad_s for k in kernels),
                    )
                ]
            times = measured.get(direction, {})
            seconds = times.get(unit)
            if seconds is None or any(k.name != unit and k.name in times for k in kernels):
                return kernels
            total = sum(k.compute_s for k in kernels)
            shares = [k.compute_s / total if total > 0 else 1 / len(kernels) for k in kernels]
            return [
                replace(k.timed(seconds * share), comm_s=k.comm_s if keep_comm else 0.0)
                for k, share in zip(kernels, shares, strict=True)
            ]

        block.fwd = one(block.fwd, "forward", name)
        block.bwd = one(block.bwd, "backward", name + "_b")
        return block

    def with_unit(self, unit: str) -> JobCosts:
        """These costs (same job, same measured times) in `unit`: itself where it is that."""
        return self if unit == self.unit else JobCosts(self.job, self.cm.measured, unit)

    def _recomputed(self, block: Block, spec, seq: int, tp: int) -> Block:
        """A layer recomputed in backward: its backward starts by running its forward again
        (with the forward's TP collectives; folded into the first backward kernel, so the
        schedule's unit counts stay the runtime's), and it keeps only its input."""
        first, *rest = block.bwd
        again = replace(
            first,
            compute_s=first.compute_s + sum(k.compute_s for k in block.fwd),
            comm_s=first.comm_s + sum(k.comm_s for k in block.fwd),
        )
        return replace(
            block,
            bwd=[again, *rest],
            act_bytes=self.cm.layer_input_bytes(spec, seq, tp),
            tags=block.tags | {"recomputed"},
        )

    def backbone_layer(self, tp: int, recomputed: bool | None = None) -> Block:
        """One backbone layer; `recomputed` None: as the job's uniform full recomputation says
        (block recomputation picks layers per stage: assemble.megatron_backbone)."""
        spec, s = self.job.backbone, self.job.seq_len
        block = Block(
            "layer",
            self.cm.layer_kernels(spec, s, tp, backward=False),
            self.cm.layer_kernels(spec, s, tp, backward=True),
            self.cm.layer_activation_bytes(spec, s, tp),
            spec.params_per_layer / tp,
            {"backbone"},
        )
        block = self._as_unit(block, spec.name, "layer")
        rc = self.job.recompute
        if recomputed is None:
            recomputed = rc.granularity == "full" and rc.method == "uniform"
        return self._recomputed(block, spec, s, tp) if recomputed else block

    def head(self, tp: int) -> Block:
        spec, s = self.job.backbone, self.job.seq_len
        act = self.job.micro_batch * s * spec.vocab_size * 4 / tp  # fp32 logits for the loss
        block = Block(
            "head",
            self.cm.head_kernels(spec, s, tp, False),
            self.cm.head_kernels(spec, s, tp, True),
            act,
            spec.vocab_size * spec.hidden_size / tp + 2 * spec.hidden_size,  # output, final norm
            {"backbone"},
        )
        return self._as_unit(block, spec.name, "head")

    def patch_embedding(self, e: int) -> Block:
        """Patches -> encoder width (a replicated linear layer) on the first encoder stage."""
        spec = self.job.encoders[e]
        s, h = self.job.encoder_seq(spec), spec.hidden_size
        patch_dim = spec.patch_dim
        flops = 2 * self.job.micro_batch * s * patch_dim * h
        block = Block(
            f"e{e}.embed",
            [Kernel("embed", self.cm._flops_s(flops))],
            []
            if self.job.frozen_encoders
            else [Kernel("embed_b", self.cm._flops_s(2 * flops), 0.0, self.cm._flops_s(flops))],
            0.0,
            patch_dim * h + h + s * h,  # weight, bias, position embeddings
            {"encoder", "frozen"} if self.job.frozen_encoders else {"encoder"},
        )
        return self._as_unit(block, spec.name, "embed")

    def encoder_layer(self, e: int, tp: int) -> Block:
        spec = self.job.encoders[e]
        s = self.job.encoder_seq(spec)
        frozen = self.job.frozen_encoders
        block = self._as_unit(
            Block(
                f"e{e}.layer",
                self.cm.layer_kernels(spec, s, tp, backward=False),
                [] if frozen else self.cm.layer_kernels(spec, s, tp, backward=True),
                0.0 if frozen else self.cm.layer_activation_bytes(spec, s, tp),
                spec.params_per_layer / tp,
                {"encoder", "frozen"} if frozen else {"encoder"},
            ),
            spec.name,
            "layer",
        )
        if self.job.recompute.vision and not frozen:  # --recompute-vision: every layer
            return self._recomputed(block, spec, s, tp)
        return block

    def projector(self, e: int, tp: int) -> Block:
        spec, llm = self.job.encoders[e], self.job.backbone
        s = self.job.encoder_seq(spec)
        return self._as_unit(
            Block(
                f"e{e}.projector",
                self.cm.projector_kernels(spec, llm, s, tp, False),
                self.cm.projector_kernels(spec, llm, s, tp, True),
                2 * self.job.micro_batch * s * llm.hidden_size * 2 / tp,
                (spec.hidden_size * llm.hidden_size + llm.hidden_size**2 + llm.hidden_size) / tp
                + llm.hidden_size,  # fc1 (column-parallel, bias split), fc2 (row, bias whole)
                {"encoder"},
            ),
            spec.name,
            "projector",
        )

    def encoder_blocks(self, e: int, tp: int) -> list[Block]:
        """Patch embedding, layers, projector (the projector includes the final norm), each
        for the job's average images per sample (its time and activations scale with them)."""
        spec = self.job.encoders[e]
        layers = [self.encoder_layer(e, tp) for _ in range(spec.num_layers)]
        blocks = [self.patch_embedding(e), *layers, self.projector(e, tp)]
        load = self.job.images_per_sample
        return blocks if load == 1.0 else [_scaled(b, load) for b in blocks]

    def backbone_blocks(self, tp: int) -> list[Block]:
        return [self.backbone_layer(tp) for _ in range(self.job.backbone.num_layers)] + [
            self.head(tp)
        ]

    def embedding(self, tp: int) -> Block:
        """The backbone's word embeddings on its first stage (vocabulary-parallel): memory and
        DP traffic only; their time rides with the first layer."""
        spec = self.job.backbone
        return Block(
            "embedding", [], [], 0.0, spec.vocab_size * spec.hidden_size / tp, {"backbone"}
        )

    @staticmethod
    def fwd_bwd_seconds(block: Block) -> float:
        return sum(k.total_s for k in block.fwd) + sum(k.total_s for k in block.bwd)


def state_bytes(block: Block, dp: int) -> float:
    """Model-state bytes on one GPU: trainable params in full, frozen ones as bf16 only."""
    frozen = block.params - block.trainable_params
    return block.trainable_params * model_state_bytes_per_param(dp) + frozen * 2.0


def _scaled(block: Block, load: float) -> Block:
    """A block for `load` times the images it was costed for (compute, its collectives and
    activations are linear in the images; the parameters are not)."""

    return replace(
        block,
        fwd=scaled_kernels(block.fwd, load),
        bwd=scaled_kernels(block.bwd, load),
        act_bytes=block.act_bytes * load,
    )
