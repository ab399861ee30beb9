"""What the runtime benchmarks share: their runs configured as pretrain_mllm.py configures one."""

from __future__ import annotations

import statistics


def bench_config(size: str):
    """The benchmarks' model at `size`: "tiny" (the fast default) or "medium" (compute-bound)."""
    from megatron_mllm.models.config import BENCH, BENCH_MEDIUM

    return {"tiny": BENCH, "medium": BENCH_MEDIUM}[size]


def bench_argv(cfg, args, plan, num_microbatches: int, micro_batch: int) -> list[str]:
    """pretrain_mllm.py's arguments for the benchmarks' runs: the model `cfg` on the backbone
    `plan`, Adam at 1e-4 clipped at 1.0, megatron-core's DDP with overlapped reduction (fp32
    gradient reduction); with --precision bf16 its distributed optimizer with overlapped
    gathers, as Megatron recipes run."""
    from megatron_mllm.training.model_args import model_argv

    argv = [
        *model_argv(cfg),
        *("--tensor-model-parallel-size", str(plan.tp)),
        *("--pipeline-model-parallel-size", str(plan.pp)),
        *("--micro-batch-size", str(micro_batch)),
        *("--global-batch-size", str(num_microbatches * micro_batch * plan.dp)),
        *("--lr", "1e-4", "--clip-grad", "1.0", "--seed", "0"),
        "--overlap-grad-reduce",
        "--accumulate-allreduce-grads-in-fp32",
    ]
    if getattr(args, "ddp_bucket_size", None):
        argv += ["--ddp-bucket-size", str(args.ddp_bucket_size)]
    if getattr(args, "precision", "fp32") == "bf16":
        argv += ["--bf16", "--use-distributed-optimizer", "--overlap-param-gather"]
    return argv


def bench_run(cfg, args, plan, num_microbatches: int, micro_batch: int, *flags: str):
    """The benchmark's run (a `training.run_config.RunConfig`) as pretrain_mllm.py's arguments
    give it (`bench_argv`, and `flags`: more of them), checked by the same rules."""
    from megatron_mllm.training.run_config import parse_run

    argv = bench_argv(cfg, args, plan, num_microbatches, micro_batch)
    return parse_run([*argv, *flags], plan.world_size)


def over_repeats(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of one figure over a benchmark's repeats."""
    return statistics.median(values), min(values), max(values)


def demo_data_or_exit(path: str) -> None:
    """Exit with one line where `path` is not the prepared energon digits `make demo` makes."""
    from megatron_mllm.data.energon_llava import check_energon_dataset
    from megatron_mllm.errors import ConfigError

    try:
        check_energon_dataset(path)
    except ConfigError as err:
        raise SystemExit(f"error: {err} (or run `make demo` once)") from None
