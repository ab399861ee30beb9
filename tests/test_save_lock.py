"""One run per --save directory (training/save_lock.py)."""

import json
import os
import socket
import subprocess
import time

from megatron_mllm.training.save_lock import LOCK
from tests.test_training import assert_refused_in_one_line, torchrun


def write_lock(root, pid: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    holder = {"host": socket.gethostname(), "pid": pid, "started": time.time()}
    (root / LOCK).write_text(json.dumps(holder))


def test_a_held_save_directory_is_refused_naming_its_holder(tmp_path):
    write_lock(tmp_path / "ckpt", os.getpid())  # a live process holds it
    assert_refused_in_one_line(
        ["--save", str(tmp_path / "ckpt")], f"is in use by process {os.getpid()} on"
    )


def test_a_stale_lock_is_taken_over_with_a_warning_and_released_at_exit(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_lock(tmp_path / "ckpt", gone.pid)
    out = torchrun("--train-iters", "1", "--save", str(tmp_path / "ckpt"), nproc=1)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"taking over the lock of process {gone.pid}" in out.stderr
    assert not (tmp_path / "ckpt" / LOCK).exists()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"
