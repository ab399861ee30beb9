"""Weight gradients computed apart from their backward (zero-bubble's B / W split).

With a split backward the schedule runs each encoder stage's backward as input-gradient
actions (EB), which must reach the previous stage soon, and weight-gradient actions (EW), which
may wait for a bubble; a split backbone backward likewise as B (input gradient) and W.
`DeferredWeightGrads` makes megatron-core's tensor-parallel linears of the encoder stages (or
of the backbone's chunks) do that: while a split step runs, each linear's backward computes its
input gradient and keeps (input, output gradient) for its weight; an EW (W) action later turns
them into the weight's gradient and hands it to the parameter's gradient accumulator, so
megatron-core's DDP hooks (main_grad, bucket readiness) see it as they see any gradient. The
arithmetic is the linear's own (`linear_with_grad_accumulation_and_async_allreduce` without
fusion): the same products in the same dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist

from megatron_mllm.errors import ConfigError
from megatron_mllm.runtime.assembly.memory import held

# A unit's deferred weight products: (parameter, its linear's input, the output's gradient).
Deferred = list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]]


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T (+ b); backward gives x's (and b's) gradient and defers W's to `store`."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner, store, allreduce_group):
        # `weight` is the parameter detached and `owner` holds the parameter (not a tensor
        # argument): autograd has no edge to its accumulator, so DDP's hooks wait for EW.
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.store, ctx.group = owner[0], store, allreduce_group
        ctx.has_bias = bias is not None
        out = torch.matmul(x, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        # As a plain 2-D matrix: an output gradient can arrive with an odd stride on a size-1
        # dimension (the projector's, sliced from the backbone's input gradient), which sends
        # a 3-D bf16 matmul on CPU down a path ~20x slower.
        g2 = grad.reshape(-1, grad.shape[-1])
        dx = g2.matmul(weight).view(*grad.shape[:-1], weight.shape[1])
        if ctx.group is not None:  # column-parallel without sequence parallelism
            dist.all_reduce(dx, group=ctx.group)
        ctx.store.keep(ctx.param, x, g2)
        db = g2.sum(dim=0) if ctx.has_bias else None
        return dx, None, db, None, None, None


def _linears(module: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    kinds = (ColumnParallelLinear, RowParallelLinear)
    return [m for m in module.modules() if isinstance(m, kinds) and m.weight.requires_grad]


class DeferredWeightGrads:
    """The linears of a rank's encoder stages (or backbone chunks) with deferrable weight
    gradients (only while `deferring`), and the deferred products per unit key until `apply`;
    `option`: the flag that asked for the split, named when its linears cannot defer."""

    def __init__(self, stages: list[torch.nn.Module], option: str = "--encoder-wgrad-split"):
        self.active, self.option = False, option
        self.pending: dict[tuple, Deferred] = {}
        self._unit: tuple | None = None  # the unit whose backward is running
        for stage in stages:
            for linear in _linears(stage):
                linear._forward_impl = partial(self._forward, linear, linear._forward_impl)

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """The linears' forwards inside build deferrable graphs (a split stage's training
        forward; elsewhere they run as megatron-core's)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _forward(self, linear, inner, input, weight, bias=None, **kw):
        if not (self.active and torch.is_grad_enabled() and weight is linear.weight):
            return inner(input, weight, bias, **kw)
        if kw.get("sequence_parallel") or kw.get("gradient_accumulation_fusion"):
            raise ConfigError(
                f"a split backward ({self.option}) runs its linears without sequence "
                "parallelism and gradient-accumulation fusion; turn those off or plan without "
                "the split"
            )
        group = kw.get("tp_group") if kw.get("allreduce_dgrad") else None
        return _DeferredLinear.apply(input, weight.detach(), bias, (weight,), self, group)

    @contextlib.contextmanager
    def unit(self, key: tuple) -> Iterator[None]:
        """The linears' backward inside keeps its products for unit `key` (and a recomputed
        forward inside defers too)."""
        self._unit, self.active = key, True
        try:
            yield
        finally:
            self._unit, self.active = None, False

    def keep(self, param: torch.nn.Parameter, x: torch.Tensor, grad: torch.Tensor) -> None:
        if self._unit is None:
            raise RuntimeError("a deferred linear's backward ran outside a split unit's")
        held(grad.nbytes)  # measured as an activation until EW lets it go (x is saved already)
        self.pending.setdefault(self._unit, []).append((param, x, grad))

    def apply(self, key: tuple) -> int:
        """Unit `key`'s weight gradients, into each parameter's accumulator (DDP's hooks);
        returns how many weight products it computed."""
        products = self.pending.pop(key, [])
        if not products:
            return 0
        held(-sum(grad.nbytes for _, _, grad in products))
        with torch.enable_grad():
            roots = [
                _WeightProduct.apply(
                    param,
                    x.detach().reshape(-1, x.shape[-1]),
                    grad.detach().reshape(-1, grad.shape[-1]),
                )
                for param, x, grad in products
            ]
        n = len(products)
        del products
        torch.autograd.backward(roots)
        return n


class _WeightProduct(torch.autograd.Function):
    """A deferred weight gradient as a graph node: its backward makes g^T x inside the
    autograd engine, where the parameter's accumulator takes it as is. A gradient handed in
    from Python (`backward(params, grads)`) is still referenced there, so the accumulator
    copies it: one more pass over every weight gradient's memory."""

    @staticmethod
    def forward(ctx, weight, x, grad):
        ctx.x, ctx.grad = x, grad
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        x, grad = ctx.x, ctx.grad
        del ctx.x, ctx.grad
        return grad.t().matmul(x), None, None


def weight_grads_of(
    stages: list[torch.nn.Module], option: str = "--encoder-wgrad-split"
) -> DeferredWeightGrads:
    """The one `DeferredWeightGrads` of a rank's encoder stages or backbone chunks (built on
    first use and kept on the first, so every executor of the rank shares one set of wrapped
    linears)."""
    store = getattr(stages[0], "_deferred_weight_grads", None)
    if store is None:
        store = DeferredWeightGrads(stages, option)
        stages[0]._deferred_weight_grads = store
    return store
