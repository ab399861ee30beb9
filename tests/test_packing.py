"""Sequence packing: several samples in one row of the sequence length, attention and positions
kept inside each sample, every sample in exactly one row; the loader packs through energon's
packing hooks and resumes where it was."""

import pickle
import random
import re
from dataclasses import replace

import pytest
import torch

from megatron_mllm.data.batch import IGNORE_INDEX, image_then_text, pack
from megatron_mllm.data.energon_loader import pack_lengths
from megatron_mllm.models.config import TINY
from megatron_mllm.runtime.assembly.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")
CFG = replace(TINY, text_len=48)  # 64 positions: room for two samples with an image each


@pytest.mark.parametrize("seed", range(5))
def test_every_sample_goes_into_exactly_one_row_within_the_length(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
    rows = pack_lengths(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert all(row == sorted(row) for row in rows) and rows == sorted(rows)
    # First fit, longest first: no two rows could have been one.
    fill = sorted(sum(lengths[i] for i in row) for row in rows)
    assert len(fill) < 2 or fill[0] + fill[1] > 64


def _sample(seed: int, text: int):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(1, 3, CFG.image_size, CFG.image_size, generator=g)
    tokens = torch.randint(1, CFG.vocab_size, (1, text), generator=g)
    return image_then_text(images, tokens, CFG.image_tokens)


def test_a_packed_row_has_its_samples_positions_and_segments():
    a, b = _sample(0, 10), _sample(1, 8)
    row = pack([a, b], CFG.seq_len, pad=0)
    assert row.tokens.shape == (1, 64) and row.num_images == 2
    assert row.positions[0].tolist() == [*range(26), *range(24), *range(14)]
    assert row.segments[0].tolist() == [0] * 26 + [1] * 24 + [-1] * 14
    assert (row.labels[0, 50:] == IGNORE_INDEX).all() and row.labels[0, 25] == IGNORE_INDEX
    mask = row.attention_mask()[0, 0]
    assert mask[30, 25] and not mask[30, 26] and mask[30, 31]  # B sees only B, causally
    with pytest.raises(ValueError, match="do not fit"):
        pack([a, b, _sample(2, 20)], CFG.seq_len, pad=0)


NATIVE = replace(TINY, text_len=48, vit_native=True, patch_size=4, image_size=16,
                 llm_mrope_section=(2, 3, 3), llm_qkv_bias=True, llm_bias=False)  # fmt: skip


def _native_sample(index: int):
    """One sample of the synthetic native-resolution data, unpadded: an image of its own
    size (its merged tokens first), then the first 16 tokens of its caption."""
    from megatron_mllm.data.synthetic import native_microbatch

    batch = native_microbatch(NATIVE, index, 1)
    length = int(batch.image_mask.sum()) + 16
    cut = dict(tokens=batch.tokens[:, :length], labels=batch.labels[:, :length])
    return replace(batch, image_mask=batch.image_mask[:, :length], **cut)


def _samples(kind: str) -> tuple:
    """Two samples and another second one: fixed-size images (CFG) or native ones (NATIVE)."""
    if kind == "native":
        return _native_sample(0), _native_sample(1), _native_sample(2)
    return _sample(0, 10), _sample(1, 8), _sample(5, 8)


def _packed_and_alone(rank: int, world: int, kind: str, state: dict) -> dict:
    from megatron_mllm.models.stages import encode
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import build_full_model

    cfg = NATIVE if kind == "native" else CFG
    init_rank(rank, world, 0, 60.0)
    model = build_full_model(cfg, "cpu", state)
    encoder, backbone = model.encoders[0], model.backbone
    params = [p for m in model.modules for p in m.parameters() if p.requires_grad]

    def run(batch):
        for p in params:
            p.grad = None
        logits = backbone(None, backbone.decoder_input([encode(encoder, batch)], batch), batch)
        loss = backbone.loss(logits, batch, summed=True)
        loss.backward()
        return logits.detach(), loss.detach(), [p.grad.clone() for p in params]

    a, b, other_b = _samples(kind)
    seq = cfg.seq_len
    alone = [run(replace(pack([x], seq, 0), positions=None, segments=None)) for x in (a, b)]
    return {
        "alone": alone,
        "packed": run(pack([a, b], seq, 0)),
        "perturbed": run(pack([a, other_b], seq, 0)),
        "lengths": [x.tokens.shape[1] for x in (a, b, other_b)],
    }


@pytest.mark.parametrize("kind", ["fixed", "native"])
def test_a_packed_row_trains_as_its_samples_one_by_one(kind):
    """Per-token loss: the packed row's loss and gradients are the sum of its samples' run
    each in its own padded row; each sample's logits are its own, and no attention crosses a
    sample (another second sample leaves the first one's logits as they were). Also with
    images of their own sizes through the native tower (attention within each image) and
    multimodal rotary positions restarting per sample."""
    from megatron_mllm.runtime.modes.reference import make_full_state

    state = spawn(make_full_state, 1, NATIVE if kind == "native" else CFG, 0)[0]
    out = spawn(_packed_and_alone, 1, kind, state)[0]
    (la, loss_a, ga), (lb, loss_b, gb) = out["alone"]
    logits, loss, grads = out["packed"]
    n_a, n_b, n_other = out["lengths"]
    assert loss == pytest.approx(float(loss_a + loss_b), rel=1e-5)
    for g, x, y in zip(grads, ga, gb, strict=True):
        torch.testing.assert_close(g, x + y, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(logits[0, :n_a], la[0, :n_a], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[0, n_a : n_a + n_b], lb[0, :n_b], rtol=1e-4, atol=1e-5)
    assert torch.equal(out["perturbed"][0][0, :n_a], logits[0, :n_a])
    assert not torch.equal(out["perturbed"][0][0, n_a : n_a + n_b], logits[0, n_a : n_a + n_b])
    if kind == "native":
        assert n_b != n_other  # images of two sizes in the second place


@pytest.fixture(scope="module")
def packing_data(llava_dataset):
    from megatron_mllm.data.llava_source import LlavaData

    path, tokenizer = llava_dataset
    return LlavaData(str(path), str(tokenizer), 128, num_workers=1, packing_buffer_size=8)


def _stream(data, micro_batch=2):
    from megatron_mllm.data.llava_source import LlavaStream

    return LlavaStream(data, "train", 0, 1, micro_batch, TINY.image_tokens, TINY.image_size, 3)


def test_the_loader_packs_each_sample_once_and_resumes_where_it_was(packing_data):
    stream = _stream(packing_data)
    try:
        first = stream.take(3)
        state = pickle.loads(pickle.dumps(stream.state()))
        after = stream.take(3)
    finally:
        stream.close()
    fresh = _stream(packing_data)
    try:
        fresh.restore(state)
        again = fresh.take(3)
    finally:
        fresh.close()
    for x, y in zip(after, again, strict=True):
        assert x.ids == y.ids and torch.equal(x.tokens, y.tokens)
        assert torch.equal(x.positions, y.positions) and torch.equal(x.images, y.images)
    assert sum(len(b.ids) for b in first + after) > 12  # several samples a row
    for batch in first + after:
        assert batch.packed and batch.tokens.shape == (2, 128)
        for row in range(2):
            seg = batch.segments[row]
            starts = (batch.positions[row] == 0) & (seg >= 0)
            assert int(starts.sum()) == int(seg.max()) + 1  # positions restart per sample
        assert int(batch.image_mask.sum()) == batch.num_images * TINY.image_tokens


def test_packing_reads_the_samples_the_padded_loader_reads(packing_data):
    """Buffer by buffer, the packed rows hold exactly the samples the padded loader reads in
    that stretch: none lost, none twice."""
    from collections import Counter

    stream, rows = _stream(packing_data, micro_batch=1), []
    try:
        while not rows or sum(len(r.ids) for r in rows) % 8:
            rows.append(stream.next())
            assert len(rows) < 64
        while sum(len(r.ids) for r in rows) < 24:
            rows.append(stream.next())
        while sum(len(r.ids) for r in rows) % 8:
            rows.append(stream.next())
    finally:
        stream.close()
    padded = _stream(replace(packing_data, packing_buffer_size=None), micro_batch=1)
    try:
        n = sum(len(r.ids) for r in rows)
        plain = [i for batch in padded.take(n) for i in batch.ids]
    finally:
        padded.close()
    assert Counter(i for r in rows for i in r.ids) == Counter(plain)
    assert len(rows) < n  # rows hold more than one sample on average


@pytest.mark.slow  # two pretrain runs; make test resumes the packing loader itself above
@pytest.mark.parametrize("schedule", ["optimus", "optimus-adaptive"])
def test_packed_training_resumes_bit_exactly(tmp_path, llava_dataset, schedule):
    """pretrain_mllm.py on packed LLaVA digits (PP=2 Optimus, or each step planned for its
    packed rows' images; bf16 with the distributed optimizer, per-token loss): a run resumed
    at iteration 2 (its loader's packing buffer in the checkpoint) continues with the
    uninterrupted run's losses and tensors."""
    from tests.pretrain_runs import LLAVA, resumed_at_2_is_bit_exact

    data, tokenizer = llava_dataset
    args = [*LLAVA, "--data-path", str(data), "--tokenizer-model", str(tokenizer),
            "--train-iters", "4", "--seq-length", "128", "--packing-buffer-size", "8",
            "--calculate-per-token-loss", "--bf16", "--use-distributed-optimizer",
            "--bubble-schedule", schedule]  # fmt: skip
    if schedule == "optimus-adaptive":  # the encoder colocated, so that there is a plan to make
        args += ["--encoder-tensor-model-parallel-size", "1",
                 "--encoder-pipeline-model-parallel-size", "1"]  # fmt: skip
    straight, _, _ = resumed_at_2_is_bit_exact(tmp_path, args)
    assert "packed: " in straight.stdout
    if schedule == "optimus-adaptive":  # whole packed rows dealt by their images
        assert "its samples dealt by encoder load" in straight.stdout
        assert re.search(r"step plans: [1-4] planned, \d+ static fallback", straight.stdout)
    # 16 rows in four iterations of 4: more samples than rows.
    packed = [int(n) for n in re.findall(r"packed samples: (\d+) \|", straight.stdout)]
    assert len(packed) == 4 and packed == sorted(packed) and packed[-1] > 16


@pytest.mark.slow  # two pretrain runs
def test_native_packed_adaptive_training_resumes_bit_exactly(tmp_path, llava_dataset):
    """The native-resolution tower on packed LLaVA digits, each step planned for its rows'
    patches and the rows dealt by them (bf16 + distributed optimizer, per-token loss): a run
    resumed at iteration 2 continues with the uninterrupted run's losses and tensors."""
    from tests.pretrain_runs import LLAVA, resumed_at_2_is_bit_exact
    from tests.test_native_resolution import QWEN_ARGS

    data, tokenizer = llava_dataset
    args = [*LLAVA, *QWEN_ARGS, "--data-path", str(data), "--tokenizer-model", str(tokenizer),
            "--train-iters", "4", "--seq-length", "128", "--packing-buffer-size", "8",
            "--min-pixels", "64", "--max-pixels", "2304", "--calculate-per-token-loss", "--bf16",
            "--use-distributed-optimizer", "--bubble-schedule", "optimus-adaptive",
            "--encoder-tensor-model-parallel-size", "1",
            "--encoder-pipeline-model-parallel-size", "1"]  # fmt: skip
    straight, _, _ = resumed_at_2_is_bit_exact(tmp_path, args)
    assert "packed: " in straight.stdout and "nominal 16x16 images (by patches)" in straight.stdout
    assert "its samples dealt by encoder load" in straight.stdout
    assert re.search(r"step plans: [1-4] planned, \d+ static fallback", straight.stdout)


@pytest.mark.parametrize(
    "extra, msg",
    [(["--packing-buffer-size", "0"], "give a buffer of 1 or more"),
     (["--packing-buffer-size", "8"], "needs --data-path"),
     (["--packing-buffer-size", "8", "--bubble-schedule", "optimus-adaptive"],
      "needs --data-path")],
)  # fmt: skip
def test_packing_arguments_are_refused_in_one_line(extra, msg, monkeypatch):
    from tests.pretrain_runs import refused

    refused(extra, msg, monkeypatch)


def test_packing_without_a_per_token_loss_is_refused(llava_dataset, monkeypatch):
    from tests.pretrain_runs import refused

    data, tokenizer = llava_dataset
    hf = ["--data-path", str(data), "--tokenizer-type", "HuggingFaceTokenizer",
          "--tokenizer-model", str(tokenizer), "--packing-buffer-size", "8"]  # fmt: skip
    refused(hf, "needs --calculate-per-token-loss", monkeypatch)
    refused([*hf, "--calculate-per-token-loss", "--coreset-pool-ratio", "2"],
            "does not run with --coreset-pool-ratio", monkeypatch)  # fmt: skip
