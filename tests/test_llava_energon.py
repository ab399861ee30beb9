"""LLaVA records as an energon dataset (data/energon_llava.py): written, read back by energon's
own loader with every record once and every image byte for byte, refused cleanly when the
output or input is bad, and resumed exactly from a saved loader state (2 workers, 1 and 2 DP
ranks)."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import tarfile
from pathlib import Path

import pytest
from megatron.energon import Cooker, TaskEncoder, stateless
from PIL import Image

from megatron_mllm.data import energon_llava, energon_loader
from megatron_mllm.data.energon_llava import check_energon_dataset, convert_llava
from megatron_mllm.data.energon_loader import (
    IdsTaskEncoder,
    close_loader,
    cook_llava,
    loader_state,
    open_loader,
    restore_loader,
)
from megatron_mllm.data.llava import read_records
from megatron_mllm.data.llava_digits import write_llava_digits
from megatron_mllm.errors import ConfigError

# get_savable_loader always asks torch for pinned memory, which warns without an accelerator.
pytestmark = pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")


class SamplesTaskEncoder(TaskEncoder):
    """Batches to the cooked samples themselves."""

    cookers = [Cooker(cook_llava)]
    decoder = None

    @stateless
    def batch(self, samples):
        return list(samples)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """40 digit records converted: 30 train, 10 val, 8 records a shard."""
    root = tmp_path_factory.mktemp("digits")
    json_path = write_llava_digits(root / "src", 40)
    counts = convert_llava(
        json_path,
        root / "src" / "images",
        root / "out",
        shard_size=8,
        val_fraction=0.25,
        progress=False,
    )
    return json_path, root / "out", counts


@pytest.fixture(autouse=True)
def no_leaked_workers():
    yield
    assert multiprocessing.active_children() == []


def read_all(path, split, task_encoder, **kw):
    kw = {"dp_rank": 0, "dp_size": 1, "batch_size": 3, "num_workers": 0, "seed": 0} | kw
    loader = open_loader(path, split, task_encoder, **kw)
    try:
        return [item for batch in loader for item in batch]
    finally:
        close_loader(loader)


def test_converted_records_read_back_once_with_original_bytes(digits):
    json_path, out, counts = digits
    assert counts == {"train": 30, "val": 10, "shards": 6}
    assert sorted(p.name for p in out.glob("*.tar")) == [
        *(f"train-{i:06d}.tar" for i in range(4)),
        "val-000000.tar",
        "val-000001.tar",
    ]
    assert (out / ".nv-meta" / "dataset.yaml").read_text() == energon_llava.DATASET_YAML
    train = read_all(out, "train", SamplesTaskEncoder(), epochs=1)
    val = read_all(out, "val", SamplesTaskEncoder(), num_workers=1)
    assert (len(train), len(val)) == (30, 10)
    records = {r.id: r for r in read_records(json_path)}
    raw = {r["id"]: r for r in json.loads(Path(json_path).read_text())}
    seen = [s.record.id for s in train + val]
    assert sorted(seen) == sorted(records)  # each record exactly once across the splits
    images = json_path.parent / "images"
    for s in train + val:
        assert s.record == records[s.record.id]
        assert s.source == raw[s.record.id]["source"]
        assert s.image_bytes == [(images / n).read_bytes() for n in s.record.images]
    kinds = {s.source: len(s.image_bytes) for s in train + val}
    assert kinds == {"digit": 1, "compare": 2, "count": 1, "math": 0}
    with tarfile.open(out / "val-000000.tar") as tar:
        names = tar.getnames()
    assert names[0].endswith(".json") and all("." in n for n in names)


def test_awkward_ids_mixed_formats_and_no_val_split(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    Image.new("RGB", (5, 3), (255, 0, 0)).save(img / "a.png")
    Image.new("RGB", (7, 9), (0, 0, 255)).save(img / "b.jpeg")
    conv = [{"from": "human", "value": "Compare."}, {"from": "gpt", "value": "Red, blue."}]
    records = [
        {"id": "x.1", "image": ["a.png", "b.jpeg"], "conversations": conv},
        {"id": "x/1", "conversations": [{"from": "human", "value": "Hi"}] + conv[1:]},
        {"id": "x_1", "image": "b.jpeg", "conversations": conv},
        {"id": "x_1", "image": "a.png", "conversations": conv},  # a repeated id is kept apart
    ]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    counts = convert_llava(
        tmp_path / "r.jsonl", img, tmp_path / "out", val_fraction=0, progress=False
    )
    assert counts == {"train": 4, "val": 0, "shards": 1}
    with tarfile.open(tmp_path / "out" / "train-000000.tar") as tar:
        keys = {n.split(".", 1)[0] for n in tar.getnames()}
        parts = {n.split(".", 1)[1] for n in tar.getnames()}
    assert len(keys) == 4 and parts == {"json", "img0.png", "img1.jpeg", "img0.jpeg"}
    got = read_all(tmp_path / "out", "train", SamplesTaskEncoder(), epochs=1)
    assert sorted(s.record.id for s in got) == ["x.1", "x/1", "x_1", "x_1"]
    two = next(s for s in got if s.record.id == "x.1")
    assert two.image_bytes == [(img / "a.png").read_bytes(), (img / "b.jpeg").read_bytes()]
    assert two.record.turns[0][1] == "<image>\n<image>\nCompare." and two.source is None
    assert next(s for s in got if s.record.id == "x/1").image_bytes == []
    with pytest.raises(ConfigError, match="no validation split"):
        open_loader(
            tmp_path / "out",
            "val",
            IdsTaskEncoder(),
            dp_rank=0,
            dp_size=1,
            batch_size=1,
            num_workers=0,
            seed=0,
        )


def test_refuses_a_non_empty_output_and_writes_nothing(tmp_path):
    json_path = write_llava_digits(tmp_path / "src", 8)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an empty folder") as err:
        convert_llava(json_path, tmp_path / "src" / "images", out, progress=False)
    assert "\n" not in str(err.value) and str(out) in str(err.value)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not an empty folder"):
        convert_llava(json_path, tmp_path / "src" / "images", tmp_path / "file", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out", "src"]
    out.joinpath("keep.txt").unlink()  # an empty OUT is fine and replaced by the dataset
    assert convert_llava(json_path, tmp_path / "src" / "images", out, progress=False)["val"] == 1


def test_bad_record_or_argument_refused_before_output_exists(tmp_path):
    json_path = write_llava_digits(tmp_path / "src", 8)
    records = json.loads(json_path.read_text())
    records[4]["image"] = "missing.png"  # a one-image "digit" record
    json_path.write_text(json.dumps(records))
    with pytest.raises(ConfigError, match="'missing.png' does not exist"):
        convert_llava(json_path, tmp_path / "src" / "images", tmp_path / "out", progress=False)
    for kw, what in (({"shard_size": 0}, "--shard-size"), ({"val_fraction": 1.0}, "--val-frac")):
        with pytest.raises(ConfigError, match=what):
            convert_llava(json_path, tmp_path / "src" / "images", tmp_path / "out", **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_failure_while_writing_leaves_no_output(tmp_path, monkeypatch):
    json_path = write_llava_digits(tmp_path / "src", 8)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(energon_llava, "_prepare", fail)
    with pytest.raises(OSError, match="disk full"):
        convert_llava(json_path, tmp_path / "src" / "images", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_check_energon_dataset_refuses_a_plain_folder(tmp_path, digits):
    (tmp_path / "plain").mkdir()
    for path in (tmp_path / "plain", tmp_path / "nowhere"):
        with pytest.raises(ConfigError, match="llava_to_energon.py") as err:
            check_energon_dataset(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    check_energon_dataset(digits[1])
    with pytest.raises(ConfigError, match="split 'test'"):
        open_loader(
            digits[1],
            "test",
            IdsTaskEncoder(),
            dp_rank=0,
            dp_size=1,
            batch_size=1,
            num_workers=0,
            seed=0,
        )


@pytest.mark.parametrize("dp_size", [1, 2])
def test_loader_resumes_exactly_from_saved_state(digits, dp_size):
    out, k = digits[1], 3
    kw = {
        "dp_size": dp_size,
        "batch_size": 2,
        "num_workers": 2,
        "seed": 7,
        "shuffle_buffer_size": 4,
        "max_samples_per_sequence": 2,
    }
    seen = []
    for rank in range(dp_size):
        loader = open_loader(out, "train", IdsTaskEncoder(), dp_rank=rank, **kw)
        try:
            it = iter(loader)
            first = [next(it) for _ in range(k)]
            state = pickle.loads(pickle.dumps(loader_state(loader)))
            reference = [next(it) for _ in range(k)]
        finally:
            close_loader(loader)
        fresh = open_loader(out, "train", IdsTaskEncoder(), dp_rank=rank, **kw)
        try:
            restore_loader(fresh, state)
            it = iter(fresh)
            assert [next(it) for _ in range(k)] == reference
        finally:
            close_loader(fresh)
        seen.append({i for batch in first + reference for i in batch})
    if dp_size == 2:
        assert not seen[0] & seen[1]  # 12 of the 15 samples each rank owns: disjoint
        val = [read_all(out, "val", IdsTaskEncoder(), dp_rank=r, dp_size=2) for r in (0, 1)]
        assert not set(val[0]) & set(val[1]) and len(val[0]) + len(val[1]) == 10


def test_cli_validates_arguments_and_prints_counts(tmp_path, run_tool):
    json_path = write_llava_digits(tmp_path / "src", 6)
    base = ["--json", str(json_path), "--image-folder", str(tmp_path / "src" / "images")]
    bad = run_tool(
        "llava_to_energon.py", *base, "--output-dir", str(tmp_path / "o"), "--shard-size", "0"
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "--shard-size 0" in bad.stderr and not (tmp_path / "o").exists()
    ok = run_tool(
        "llava_to_energon.py",
        *base,
        "--output-dir",
        str(tmp_path / "o"),
        "--shard-size",
        "4",
        "--val-fraction",
        "0.2",
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == f"wrote 5 train and 1 val records in 3 shards to {tmp_path / 'o'}"


def test_a_damaged_shard_is_counted_left_out_whole_or_refused(digits, tmp_path):
    """energon stops a run at the first sample past a shard's end: a shard cut short (or
    missing, or not a tar) is counted, and left out whole while the samples left out stay
    within the fraction; above it, or with a split left empty, refused in one line."""
    import os
    import shutil

    data = shutil.copytree(digits[1], tmp_path / "data")
    assert energon_llava.account_samples(data, 0.0).left_out == ()  # intact
    counts = energon_llava.unreadable_samples(data)
    shard = sorted(name for name in counts if name.startswith("train"))[0]
    indexed = counts[shard][0]
    os.truncate(data / shard, (data / shard).stat().st_size // 2)
    indexed_now, lost = energon_llava.unreadable_samples(data)[shard]
    assert indexed_now == indexed and 0 < lost < indexed
    total = sum(n for n, _ in counts.values())
    with pytest.raises(
        ConfigError,
        match=rf"{shard} \({lost} of {indexed} unreadable\).*"
        rf"skips {indexed} of {total} samples.*fraction 0.1;",
    ) as err:
        energon_llava.account_samples(data, 0.1)
    assert "\n" not in str(err.value)
    account = energon_llava.account_samples(data, 0.5)
    assert account.left_out == (shard,) and account.dropped == indexed
    kept = read_all(data, "train", IdsTaskEncoder(), epochs=1, exclude_shards=(shard,))
    every = read_all(digits[1], "train", IdsTaskEncoder(), epochs=1)
    assert len(kept) == len(every) - indexed and set(kept) < set(every)
    assert not list(tmp_path.glob("data/.nv-meta/*split_*"))  # the data set is left as it was
    (data / shard).write_bytes(os.urandom(4096))  # random bytes: not a tar at all
    assert energon_llava.unreadable_samples(data)[shard] == (indexed, indexed)
    (data / shard).unlink()
    assert energon_llava.unreadable_samples(data)[shard] == (indexed, indexed)
    for name in counts:
        if name.startswith("val"):
            (data / name).unlink()
    with pytest.raises(ConfigError, match="every val shard is damaged"):
        energon_llava.account_samples(data, 0.9)


def test_sources_are_counted_and_a_record_without_one_is_named(digits, tmp_path):
    """The coreset's sources are the records' "source" field, counted at conversion; a data set
    where some record has none is refused in one line."""
    json_path, out, counts = digits
    assert energon_llava.train_sources(out) == ("compare", "count", "digit", "math")
    records = json.loads(Path(json_path).read_text())
    del records[3]["source"]
    (tmp_path / "some.json").write_text(json.dumps(records))
    images = Path(json_path).parent / "images"
    convert_llava(tmp_path / "some.json", images, tmp_path / "o", 8, 0.25, progress=False)
    with pytest.raises(ConfigError, match='1 of 30 training records have no "source"') as err:
        energon_llava.train_sources(tmp_path / "o")
    assert "\n" not in str(err.value)


def test_a_member_that_does_not_decode_is_skipped_counted_and_named(llava_dataset):
    """In a loader worker: a sample whose image bytes or record JSON do not decode is skipped
    (energon's SkipSample, no traceback) and the next batch names it, with its shard, for the
    training process to count (and refuse past --max-skipped-samples-fraction)."""
    import json as json_module
    from dataclasses import replace

    from megatron.energon import SkipSample

    from megatron_mllm.data.llava_source import LlavaData

    _, tokenizer = llava_dataset
    spec = LlavaData("unused", str(tokenizer), 128).spec(4, 16)
    encoder = energon_loader.LlavaTaskEncoder(spec)
    meta = {"id": "r1", "images": ["a.png"], "turns": [["human", "<image>\nwhat?"], ["gpt", "1"]]}
    from megatron.energon.source_info import SourceInfo

    where = (SourceInfo(dataset_path="data", index=7, shard_name="train-000003.tar",
                        file_names=("r1.json",)),)  # fmt: skip
    crude = {"__key__": "r1", "__sources__": where, "__restore_key__": ("Webdataset", 7),
             "json": json_module.dumps(meta).encode(), "img0.png": b"\x89PNG broken"}  # fmt: skip
    sample = energon_loader.cook_llava(crude)
    with pytest.raises(SkipSample):
        encoder.encode_sample(sample)
    with pytest.raises(SkipSample):
        energon_loader.cook_llava({**crude, "__key__": "r2", "json": b"\xff{not json"})
    good = replace(sample, record=replace(sample.record, images=()), image_bytes=[])
    good = replace(good, record=replace(good.record, turns=(("human", "1+1?"), ("gpt", "2"))))
    batch = encoder.batch([encoder.encode_sample(good)])
    assert len(batch.corrupted) == 2
    assert batch.corrupted[0].startswith("sample r1 of shard train-000003.tar (")
    assert batch.corrupted[1].startswith("sample r2 of shard train-000003.tar (")
    assert encoder.batch([encoder.encode_sample(good)]).corrupted == ()  # each named once


@pytest.mark.slow  # two torchrun jobs
def test_corrupted_members_at_training_time_are_counted_and_refused_past_the_fraction(
    tmp_path, llava_dataset
):
    """Image members overwritten in place (the shards' index still fits): the run counts the
    samples it skips in its log line and names them; past --max-skipped-samples-fraction it
    stops in one line."""
    import re
    import shutil
    import tarfile

    from tests.pretrain_runs import LLAVA, torchrun

    data, tokenizer = llava_dataset
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    for shard in copy.glob("train-*.tar"):
        with tarfile.open(shard) as tar:
            spans = [(m.offset_data, m.size) for m in tar.getmembers() if ".img" in m.name]
        with open(shard, "r+b") as f:
            for offset, size in spans:
                f.seek(offset)
                f.write(b"\0" * size)
    args = [*LLAVA, "--train-iters", "2", "--data-path", str(copy),
            "--tokenizer-model", str(tokenizer)]  # fmt: skip
    tolerated = torchrun(*args, "--max-skipped-samples-fraction", "0.99")
    assert tolerated.returncode == 0, tolerated.stderr[-3000:]
    counts = [int(n) for n in re.findall(r"corrupted samples skipped: (\d+)", tolerated.stdout)]
    assert counts and counts[-1] > 0 and counts == sorted(counts)
    assert re.search(r"WARNING: train data: skipped sample \S+ of shard train-", tolerated.stderr)
    stopped = torchrun(*args)
    line = [x for x in stopped.stderr.splitlines() if "had members that do not decode" in x]
    assert stopped.returncode != 0 and line and "--max-skipped-samples-fraction 0.01" in line[0]
