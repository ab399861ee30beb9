"""Shared helpers: tiny jobs that plan in milliseconds, and the GPU rule for tests marked `gpu`
or `gpus(n)`: without CUDA (or with fewer than n GPUs) they skip, except under `make gpu-check`
(MEGATRON_MLLM_GPU_CHECK=1), where they fail with one line saying what is missing. Run as a
script, this file prints that line and exits 1 when CUDA is missing (the target's first step)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron_mllm.schedule.config import MLLMJob
from megatron_mllm.schedule.hardware import get_profile
from megatron_mllm.schedule.specs import TransformerSpec

ROOT = Path(__file__).resolve().parents[1]
# The benchmarks' own modules (tools/bench_data, bench_common) are importable by tests as by tools.
sys.path.insert(0, str(ROOT / "tools"))


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
        # without the fitted per-chunk overhead: at these microsecond kernels it would be all
        # a schedule's time
        hw=get_profile("h100").with_chunk_overhead(0.0),
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


GPU_CHECK = os.environ.get("MEGATRON_MLLM_GPU_CHECK") == "1"
# With GPU_CHECK: deselect (and name) the tests that need more GPUs than are present, instead of
# failing them; tools/gpu_check.sh sets it on the one-GPU machine. `make gpu-check` does not.
GPU_LIMIT = os.environ.get("MEGATRON_MLLM_DESELECT_OVER_GPUS") == "1"


def _python() -> str:
    exe = os.path.relpath(sys.executable)
    return sys.executable if exe.startswith("..") else exe


def cuda_missing() -> str | None:
    """The one line saying CUDA is missing, or None where it is there."""
    import torch

    if torch.cuda.is_available():
        return None
    version = torch.__version__.split("+")[0]
    return (
        f"gpu-check: CUDA is not available to {_python()} (torch {torch.__version__}); install a"
        f" CUDA build of torch first, e.g. pip install torch=={version} --index-url"
        " https://download.pytorch.org/whl/cu126, or run tools/gpu_check.sh on the GPU machine"
    )


def gpus_needed(item) -> int:
    """How many GPUs a test needs: n from `gpus(n)`, 1 for a plain `gpu` mark, else 0."""
    mark = item.get_closest_marker("gpus")
    if mark is not None:
        return int(mark.args[0] if mark.args else mark.kwargs["n"])
    return 1 if item.get_closest_marker("gpu") is not None else 0


def gpu_shortfall(need: int, check: bool = GPU_CHECK) -> str | None:
    """Why `need` GPUs are not to be had here, or None: a short skip reason, or with `check`
    the one gpu-check line."""
    if need < 1:
        return None
    missing = cuda_missing()
    if missing is not None:
        return missing if check else "needs CUDA"
    import torch

    have = torch.cuda.device_count()
    if have >= need:
        return None
    short = f"needs {need} GPUs; {have} {'is' if have == 1 else 'are'} present"
    return f"gpu-check: this test {short}" if check else short


@pytest.hookimpl(tryfirst=True)  # before -m selects: a gpus(n) test is a gpu test too
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpus") is not None and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
    if not (GPU_CHECK and GPU_LIMIT) or cuda_missing() is not None:
        return
    import torch

    have = torch.cuda.device_count()
    over = [item for item in items if gpus_needed(item) > have]
    if over:
        dropped = {id(item) for item in over}
        items[:] = [item for item in items if id(item) not in dropped]
        config.hook.pytest_deselected(items=over)
        config._gpu_deselected = (have, [item.nodeid for item in over])


def pytest_terminal_summary(terminalreporter, config):
    have, names = getattr(config, "_gpu_deselected", (0, []))
    if names:
        terminalreporter.write_line(
            f"gpu-check: deselected {len(names)} test(s) needing more than the {have} GPU(s)"
            f" present: {', '.join(names)}"
        )


def pytest_runtest_setup(item):
    short = gpu_shortfall(gpus_needed(item))
    if short is not None and not GPU_CHECK:
        pytest.skip(short)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """Under gpu-check a missing GPU fails the test itself (FAILED, not ERROR or SKIPPED)."""
    short = gpu_shortfall(gpus_needed(item)) if GPU_CHECK else None
    if short is not None:
        pytest.fail(short, pytrace=False)


if __name__ == "__main__":
    sys.exit(cuda_missing())


@pytest.fixture(scope="session")
def llava_dataset(tmp_path_factory):
    """The tiny LLaVA-format digits (60 records) and its tokenizer, converted for energon:
    (dataset folder, tokenizer folder)."""
    from megatron_mllm.data.energon_llava import convert_llava
    from megatron_mllm.data.llava_digits import conversation_texts, write_llava_digits
    from megatron_mllm.data.tokenizer import train_tiny_tokenizer

    root = tmp_path_factory.mktemp("llava")
    json_path = write_llava_digits(root / "src", 60)
    train_tiny_tokenizer(conversation_texts(json_path), root / "tokenizer", 300)
    convert_llava(json_path, root / "src" / "images", root / "energon", 16, 0.2, progress=False)
    return root / "energon", root / "tokenizer"
