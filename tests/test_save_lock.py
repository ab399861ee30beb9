"""One run per --save directory (training/save_lock.py)."""

import subprocess
import sys

from megatron_mllm.training.save_lock import LOCK, acquire, release
from tests.pretrain_runs import assert_refused_in_one_line, torchrun

HOLD = """
import sys, time
from megatron_mllm.training.save_lock import acquire
acquire(sys.argv[1]); print("held", flush=True); time.sleep(60)
"""


def test_a_held_save_directory_is_refused_naming_its_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "ckpt")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert_refused_in_one_line(
            ["--save", str(tmp_path / "ckpt")], f"is in use by process {holder.pid} on"
        )
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holders_lock_is_taken_over_with_a_warning_and_released_at_exit(tmp_path, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "ckpt")], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    holder.kill()  # -9: the kernel drops its lock, its record stays
    holder.wait()
    out = torchrun("--train-iters", "1", "--save", str(tmp_path / "ckpt"), nproc=1)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"taking over the lock of process {holder.pid}" in out.stderr
    assert (tmp_path / "ckpt" / LOCK).read_text() == ""  # released cleanly
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"
    acquire(str(tmp_path / "ckpt"))  # after a clean release: taken without a warning
    assert "taking over" not in capsys.readouterr().err
    release(tmp_path / "ckpt" / LOCK)


def test_planted_links_in_save_are_refused_and_their_targets_untouched(tmp_path):
    """A link planted as the lock, the tracker or an iteration folder is refused in one line;
    the tracker is replaced through a fresh temporary file, never written through a link."""
    import pytest

    from megatron_mllm.errors import ConfigError
    from megatron_mllm.training.checkpointing import TRACKER, refuse_links, write_tracker

    save, target = tmp_path / "ckpt", tmp_path / "victim.txt"
    save.mkdir()
    target.write_text("precious")
    (save / LOCK).symlink_to(target)
    with pytest.raises(ConfigError, match=f"{LOCK} is a symbolic link") as err:
        acquire(str(save))
    assert "\n" not in str(err.value) and target.read_text() == "precious"
    (save / LOCK).unlink()
    (save / TRACKER).symlink_to(target)
    with pytest.raises(ConfigError, match=f"{TRACKER} is a symbolic link"):
        refuse_links(save, save / "iter_0000002")
    write_tracker(save, 7)  # even where a caller did not refuse first: the link is replaced
    assert target.read_text() == "precious" and not (save / TRACKER).is_symlink()
    assert (save / TRACKER).read_text() == "7" and sorted(p.name for p in save.iterdir()) == [
        TRACKER
    ]
    (save / "iter_0000002").symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="iter_0000002 is a symbolic link"):
        refuse_links(save, save / "iter_0000002")
