"""What the runtime benchmarks share."""

from __future__ import annotations


def bench_optimizer(args):
    """The benchmarks' optimizer: with bf16 megatron-core's distributed optimizer with
    overlapped reduce-scatter and gather and fp32 reduction, as Megatron recipes run."""
    from megatron_mllm.runtime.job import OptimizerSettings

    bf16 = args.precision == "bf16"
    return OptimizerSettings(
        lr=1e-4,
        clip_grad=1.0,
        overlap_grad_reduce=True,
        ddp_bucket_size=args.ddp_bucket_size,
        distributed=bf16,
        overlap_param_gather=bf16,
        grad_reduce_in_fp32=True,
    )
