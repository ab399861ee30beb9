"""Checkpoints are data, never code (patches/safe_checkpoint_loading.py): a payload that would
create a marker file when unpickled, placed in each kind of checkpoint file, never runs and is
refused in one line; what we save ourselves (RNG streams, energon's loader position, the
coreset selector) is plain data that loads with weights_only."""

from __future__ import annotations

import io
import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron_mllm_patches.safe_checkpoint_loading import refusal_in

from megatron_mllm.errors import ConfigError
from megatron_mllm.training import checkpointing  # installs the safe loading
from tests.pretrain_runs import refused

# What megatron-core's dist_checkpointing writes beside every checkpoint.
METADATA_JSON = (
    '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", '
    '"common_backend_version": 1}'
)


class Payload:
    """Unpickled, it creates `marker` (any code could run in its place)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_payload_in_the_metadata_does_not_run(tmp_path):
    good, bad, marker = tmp_path / "good", tmp_path / "bad", tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "step": 4}, checkpoint_id=str(good), no_dist=True)
    state = {"w": torch.zeros(3), "step": 0}
    dcp.load(state, checkpoint_id=str(good), no_dist=True)  # genuine metadata still loads
    assert torch.equal(state["w"], torch.ones(3)) and state["step"] == 4
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(bad), no_dist=True)
    (bad / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(BaseException) as e:  # inside torch's CheckpointException
        dcp.load({"w": torch.zeros(3)}, checkpoint_id=str(bad), no_dist=True)
    line = refusal_in(e.value)
    assert line and "asks for io.open, which checkpoint metadata never holds" in line
    assert not marker.exists()


def test_a_payload_among_the_objects_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    dcp.save({"obj": Payload(str(marker))}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert not marker.exists()  # saving pickles it; only unpickling would run it
    with pytest.raises(BaseException) as e:
        dcp.load({"obj": None}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    line = refusal_in(e.value)
    assert line and line.startswith("checkpoint object obj is not plain data")
    assert not marker.exists()


def test_a_payload_in_common_pt_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    root = tmp_path / "ckpt"
    (root / "iter_0000002").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    torch.save({"common": {"x": Payload(str(marker))}}, root / "iter_0000002" / "common.pt")
    (root / "iter_0000002" / "metadata.json").write_text(METADATA_JSON)
    with pytest.raises(ConfigError, match="common.pt is not plain data") as e:
        checkpointing.read_common(str(root))
    assert "\n" not in str(e.value) and not marker.exists()


def _weights_only_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_what_we_save_is_plain_data():
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    saved = _weights_only_round_trip(checkpointing.capture_rng_state())
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(0)
    np.random.seed(0)
    checkpointing.restore_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_energons_loader_state_is_plain_data_and_only_its_classes_come_back():
    from megatron.energon.rng import SystemRngState
    from megatron.energon.savable_loader import (
        SavableDataLoaderState,
        SavableDatasetCheckpoint,
        SavableDatasetState,
    )
    from megatron.energon.state import FlexState

    from megatron_mllm.data.energon_loader import plain_state, state_of_plain

    rng = SystemRngState(torch=torch.get_rng_state(), numpy=np.random.get_state(),
                         random=random.getstate())  # fmt: skip
    inner = SavableDatasetState(
        rng=rng, dataset_state=FlexState({"a": [1, (2, 3)]}), sample_index=7
    )
    state = SavableDataLoaderState(
        worker_states=[SavableDatasetCheckpoint(state=inner, offset=2), FlexState({0: None})],
        next_worker_id=1,
        micro_batch_size=4,
    )
    back = state_of_plain(_weights_only_round_trip(plain_state(state)))
    assert type(back) is SavableDataLoaderState and back.next_worker_id == 1
    first = back.worker_states[0]
    assert first.offset == 2 and first.state.sample_index == 7
    assert first.state.dataset_state == {"a": [1, (2, 3)]}
    assert type(first.state.dataset_state) is FlexState
    kind, keys, *rest = first.state.rng.numpy
    assert kind == "MT19937" and keys.dtype == np.uint32
    assert np.array_equal(keys, rng.numpy[1]) and tuple(rest) == tuple(rng.numpy[2:])
    assert torch.equal(first.state.rng.torch, rng.torch) and first.state.rng.random == rng.random
    for name in ("os.system", "builtins.eval", "megatron.energon.rng.os"):
        with pytest.raises(ConfigError, match="not one of energon's state classes"):
            state_of_plain({"__class__": name, "fields": {}})


def test_a_removed_manifest_is_refused_where_the_run_has_others(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    for it in (2, 4):
        (root / f"iter_{it:07d}").mkdir(parents=True)
    (root / "iter_0000002" / "manifest.json").write_text('{"run_id": "r", "files": {}}')
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    refused(["--load", str(root)], "iteration 4 has no manifest while iter_0000002", monkeypatch)
