"""Shared helpers: tiny jobs that plan in milliseconds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_mllm.schedule.config import MLLMJob
from megatron_mllm.schedule.hardware import get_profile
from megatron_mllm.schedule.specs import TransformerSpec

ROOT = Path(__file__).resolve().parents[1]


def tiny_encoder(layers: int = 4, hidden: int = 256, name: str = "tiny-vit") -> TransformerSpec:
    return TransformerSpec(name, layers, hidden, 4 * hidden, 4, causal=False)


def tiny_backbone(layers: int = 8, hidden: int = 512) -> TransformerSpec:
    return TransformerSpec("tiny-gpt", layers, hidden, 4 * hidden, 8, causal=True, vocab_size=1024)


def tiny_job(
    gpus: int = 8,
    tp: int = 2,
    pp: int = 2,
    vpp: int = 1,
    microbatches: int = 4,
    encoders: tuple[TransformerSpec, ...] | None = None,
    frozen: bool = False,
    backbone_layers: int = 8,
) -> MLLMJob:
    dp = gpus // (tp * pp)
    return MLLMJob(
        encoders or (tiny_encoder(),),
        tiny_backbone(backbone_layers),
        gpus,
        tp,
        pp,
        global_batch=microbatches * dp,
        micro_batch=1,
        seq_len=128,
        hw=get_profile("h100"),
        vpp=vpp,
        frozen_encoders=frozen,
    )


@pytest.fixture
def run_tool():
    """Run a tools/ script in a subprocess; returns CompletedProcess."""
    import subprocess

    def _run(script: str, *args: str):
        return subprocess.run(
            [sys.executable, str(ROOT / "tools" / script), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    return _run
