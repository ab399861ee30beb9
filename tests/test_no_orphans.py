"""kill -9 of a rank leaves no helper process behind (patches/checkpoint_helpers_die_with_rank:
dist_checkpointing's Manager server and writers die with their rank)."""

import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_mllm.runtime.assembly.launch import free_port
from tests.conftest import ROOT


def test_a_rank_killed_after_a_save_leaves_no_helper_process(tmp_path):
    killed_after_a_save_leaves_nothing(tmp_path, [])


@pytest.mark.slow  # with energon's loader worker (torch's DataLoader watches its parent)
def test_a_rank_reading_conversations_leaves_no_loader_worker(tmp_path, llava_dataset):
    data, tokenizer = llava_dataset
    killed_after_a_save_leaves_nothing(
        tmp_path,
        ["--data-path", str(data), "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", str(tokenizer), "--seq-length", "96", "--num-workers", "1"],
    )  # fmt: skip


def killed_after_a_save_leaves_nothing(tmp_path, extra: list[str]) -> None:
    """Train until the first checkpoint, kill -9 the rank, and no process it started lives on
    (within 15 s: the loader workers' own parent check runs every 5 s)."""
    save = tmp_path / "ckpt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--master-port", str(free_port()), str(ROOT / "pretrain_mllm.py"),
        "--train-iters", "100000", "--lr", "1e-4", "--lr-decay-style", "constant",
        "--save", str(save), "--save-interval", "1", *extra,
    ]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not (save / "latest_checkpointed_iteration.txt").exists():
            assert launcher.poll() is None, launcher.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
        (rank,) = psutil.Process(launcher.pid).children()
        helpers = rank.children(recursive=True)
        assert helpers, "a save starts helper processes (the test would not test anything)"
        rank.send_signal(signal.SIGKILL)
        launcher.wait(timeout=60)
        _, alive = psutil.wait_procs(helpers, timeout=15)
        assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]
    finally:
        for p in (
            psutil.Process(launcher.pid).children(recursive=True) if launcher.poll() is None else []
        ):
            p.kill()
        launcher.kill()
