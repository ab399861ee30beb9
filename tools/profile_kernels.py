#!/usr/bin/env python
"""Measure per-kernel times (forward and backward) of one layer of each model at its TP shard's
shapes and write them as a measured-times JSON that `plan_schedule.py --measured-times` reads.

    python tools/profile_kernels.py --model vit-22b --model gpt-175b --tp 8 --micro-batch 2 \
        --seq-len 2048 --encoder-seq-len 1024 --dtype bf16 --device cuda --out times.json

An encoder (a ViT) runs --encoder-seq-len tokens (its own seq_len where its spec has one), a
backbone --seq-len. See megatron_mllm/runtime/planning/profile_kernels.py for what is timed and how.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_mllm.errors import ConfigError, exit_on_config_error

DTYPES = ("bf16", "fp16", "fp32")


def _profile(rank: int, world: int, specs: list, args: argparse.Namespace) -> dict:
    import torch

    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.planning.profile_kernels import kernel_times

    device = init_rank(rank, world, 0, 600.0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    out = {}
    for spec in specs:
        seq = spec.seq_len or (args.seq_len if spec.causal else args.encoder_seq_len)
        out[spec.name] = kernel_times(
            spec, args.tp, args.micro_batch, seq, dtype, device, args.repeats
        )
    return out


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="a built-in name or a YAML")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048, help="the backbone's tokens")
    ap.add_argument("--encoder-seq-len", type=int, default=1024, help="an encoder's tokens")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True, help="the measured-times JSON to write")
    args = ap.parse_args(argv)
    import torch

    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.schedule.specs import load_model

    for name in ("tp", "micro_batch", "seq_len", "encoder_seq_len", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: give >= 1")
    if (args.device == "cuda") != torch.cuda.is_available():
        raise ConfigError(
            f"--device {args.device} on a machine where CUDA is "
            f"{'available' if torch.cuda.is_available() else 'not available'}; use --device "
            f"{'cuda' if torch.cuda.is_available() else 'cpu'}"
        )
    specs = [load_model(m, encoder=False) for m in args.model]
    for spec in specs:
        if spec.num_heads % args.tp or spec.ffn_hidden_size % args.tp:
            raise ConfigError(f"{spec.name} does not split over TP {args.tp}")
    times = spawn(_profile, 1, specs, args)[0]
    with open(args.out, "w") as f:
        json.dump(times, f, indent=1)
    for name, t in times.items():
        fwd, bwd = sum(t["forward"].values()), sum(t["backward"].values())
        print(
            f"{name}: layer forward {1e3 * fwd:.2f} ms, backward {1e3 * bwd:.2f} ms (TP {args.tp})"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
