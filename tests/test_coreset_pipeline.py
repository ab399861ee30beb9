import pytest
import torch
from bench_data.mixture import VOCAB, build_mixture

from megatron_mllm.data.coreset import CoresetConfig
from megatron_mllm.data.sampler import CoresetHook, PoolSampler, answer_loss
from megatron_mllm.errors import ConfigError


@pytest.fixture(scope="module")
def mixture():
    return build_mixture(600, seed=0, seq_len=32, heldout_per_source=8)


def test_mixture_is_imbalanced_deterministic_and_held_out(mixture):
    train, held = mixture
    counts = torch.bincount(train.source)
    assert counts.max() >= 5 * counts.min()  # a few big sources, several small
    again, _ = build_mixture(600, seed=0, seq_len=32, heldout_per_source=8)
    assert torch.equal(again.tokens, train.tokens)
    assert torch.equal(torch.bincount(held.source), torch.full((len(held.names),), 8))
    assert train.answer_mask.any(1).all()  # every example has answer tokens to learn


def test_empty_source_is_refused():
    with pytest.raises(ConfigError, match="would be empty"):
        build_mixture(100, sources={"addition": 0.999, "square": 0.001})


def test_pool_sampler_counts_the_whole_pool_and_resumes():
    sampler = PoolSampler(100, 32, seed=3)
    it = iter(sampler)
    pools = [next(it) for _ in range(5)]
    assert sampler.consumed_samples == 5 * 32
    resumed = PoolSampler(100, 32, seed=3)
    resumed.load_state_dict({"consumed_samples": 2 * 32, "seed": 3})
    it2 = iter(resumed)
    assert all(torch.equal(next(it2), p) for p in pools[2:])
    with pytest.raises(ConfigError, match="pool of 200"):
        PoolSampler(100, 200)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.output_layer = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens).transpose(0, 1)  # [s, b, h] like megatron-core
        return self.output_layer(h).transpose(0, 1)


def test_hook_selects_b_from_the_pool_with_the_models_last_layer(mixture):
    train, _ = mixture
    model = TinyLM(len(VOCAB))
    pool = torch.arange(64)
    hook = CoresetHook(CoresetConfig(batch_size=32, features="exact"), model.output_layer)
    hidden = hook.last_layer_inputs(model, train.tokens[pool])
    # The replayed last layer reproduces the model's own loss.
    direct = answer_loss(model(train.tokens[pool]), train.tokens[pool], train.answer_mask[pool])
    replay = answer_loss(
        hidden @ model.output_layer.weight.T, train.tokens[pool], train.answer_mask[pool]
    )
    torch.testing.assert_close(direct, replay)
    chosen = hook.select(model, train.tokens[pool], train.answer_mask[pool], train.source[pool])
    assert len(chosen) == 32 and chosen.max() < 64 and len(set(chosen.tolist())) == 32


def test_dp_ranks_split_the_pool():
    shares = [next(iter(PoolSampler(100, 32, seed=1, dp_rank=d, dp_size=2))) for d in range(2)]
    whole = next(iter(PoolSampler(100, 32, seed=1)))
    assert set(shares[0].tolist()).isdisjoint(shares[1].tolist())
    assert sorted(torch.cat(shares).tolist()) == sorted(whole.tolist())


def _broadcast(rank, world):
    import torch.distributed as dist

    from megatron_mllm.data.sampler import broadcast_selection

    dist.init_process_group("gloo")
    mine = torch.tensor([3, 1, 4, 1]) if rank == world - 1 else None
    return broadcast_selection(mine, 4, None, src=world - 1).tolist()


def test_pipeline_stages_get_the_last_stages_selection():
    from megatron_mllm.runtime.assembly.launch import spawn

    assert spawn(_broadcast, 2) == [[3, 1, 4, 1], [3, 1, 4, 1]]


def test_digit_shards_round_trip(tmp_path):
    from bench_data.digit_shards import ImageCaptionShards, write_digit_shards

    paths = write_digit_shards(tmp_path / "d", per_shard=1000)
    assert len(paths) == 2 and all(p.suffix == ".tar" for p in paths)
    data = ImageCaptionShards(tmp_path / "d")
    assert len(data) == 1797 and data.captions[0] == "a handwritten zero"
    images, text = data.batch([0, 1], 32, 3, 20, 128)
    assert images.shape == (2, 3, 32, 32) and text.shape == (2, 20)
    assert "".join(chr(t) for t in text[1].tolist()).strip() == "a handwritten one"
    with pytest.raises(ConfigError, match="no .tar shards"):
        ImageCaptionShards(tmp_path)


def test_megatron_energon_reads_the_digit_shards(tmp_path):
    """The shards are an energon dataset: energon's own loader yields every sample of ours."""
    from bench_data.digit_shards import ImageCaptionShards, write_digit_shards
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    write_digit_shards(tmp_path / "d", per_shard=1000)
    ours = ImageCaptionShards(tmp_path / "d")
    dataset = get_val_dataset(
        str(tmp_path / "d"),
        split_part="train",
        batch_size=64,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
    )
    seen = []
    for batch in get_loader(dataset):
        seen += [(c, bytes(i.tobytes())) for c, i in zip(batch.caption, batch.image, strict=True)]
    expected = [(c, i.tobytes()) for c, i in zip(ours.captions, ours.images, strict=True)]
    assert sorted(seen) == sorted(expected)


def _pool(n=24, s=6, h=8, vocab=16):
    """A pool's output-layer inputs, labels (some positions unlabelled), sources and weight."""
    from megatron_mllm.data.batch import IGNORE_INDEX

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, s, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (n, s), generator=g)
    labels[:, :2] = IGNORE_INDEX
    sources = torch.randint(0, 3, (n,), generator=g)
    weight = torch.randn(vocab, h, generator=g, dtype=torch.float64)
    return hidden, labels, sources, weight


def _plain_loss(h, t, block):
    """The replay's loss, written the obvious way."""
    keep = t != -100
    ce = torch.nn.functional.cross_entropy(
        (h @ block.T).transpose(1, 2), t.clamp(min=0), reduction="none"
    )
    return (ce * keep).sum(-1) / keep.sum(-1)


@pytest.mark.parametrize("shape", [(24, 6, 8), (24, 3, 64)], ids=["held", "regrouped"])
def test_closed_form_features_are_what_perturbation_approximates(shape):
    """The MLLM replay's zeroth-order features (closed form) equal the generic replay's
    two-sided perturbation along the same directions, to its O(eps^2); with the examples'
    gradients held at once and, where they outgrow a chunk's memory, made in groups."""
    import dataclasses

    from megatron_mllm.data.coreset import CoresetSelector, LossReplay
    from megatron_mllm.data.sampler import VocabParallelReplay

    n, s, h = shape
    hidden, labels, _, weight = _pool(n, s, h)  # s - 2 labelled positions
    config = CoresetConfig(batch_size=10, seed=2)
    closed = CoresetSelector(config).features(VocabParallelReplay(), hidden, labels, weight)
    fine = dataclasses.replace(config, epsilon=1e-5)
    perturbed = CoresetSelector(fine).features(LossReplay(_plain_loss), hidden, labels, weight)
    torch.testing.assert_close(closed, perturbed, rtol=1e-6, atol=1e-8)


def _tp_selection(rank, world, features):
    """Each TP rank holds half of the output layer's vocabulary rows; selects with them."""
    import torch.distributed as dist

    from megatron_mllm.data.coreset import CoresetSelector
    from megatron_mllm.data.sampler import VocabParallelReplay

    dist.init_process_group("gloo")
    hidden, labels, sources, weight = _pool()
    rows = weight.shape[0] // world
    replay = VocabParallelReplay(dist.group.WORLD, rank * rows, weight.shape[0])
    selector = CoresetSelector(CoresetConfig(batch_size=10, features=features, seed=2))
    shard = weight[rank * rows : (rank + 1) * rows]
    feats = selector.features(replay, hidden, labels, shard)
    selector = CoresetSelector(CoresetConfig(batch_size=10, features=features, seed=2))
    return selector.select(sources, replay, hidden, labels, shard).tolist(), feats


@pytest.mark.parametrize("features", ["zo", "exact"])
def test_tp2_selection_equals_tp1_selection(features):
    """Under a vocabulary-parallel output layer (TP 2, the softmax reduced over the TP group)
    the features and the selection equal TP 1's; TP 1's replay reproduces the plain loss and
    autograd's per-example gradients."""
    from megatron_mllm.data.coreset import CoresetSelector, LossReplay
    from megatron_mllm.data.sampler import VocabParallelReplay
    from megatron_mllm.runtime.assembly.launch import spawn

    hidden, labels, sources, weight = _pool()
    replay = VocabParallelReplay()

    plain = _plain_loss
    torch.testing.assert_close(replay.losses(hidden, labels, weight[None])[0],
                               plain(hidden, labels, weight))  # fmt: skip
    torch.testing.assert_close(replay.gradients(hidden, labels, weight),
                               LossReplay(plain).gradients(hidden, labels, weight))  # fmt: skip
    config = CoresetConfig(batch_size=10, features=features, seed=2)
    tp1_feats = CoresetSelector(config).features(replay, hidden, labels, weight)
    tp1 = CoresetSelector(config).select(sources, replay, hidden, labels, weight).tolist()
    for picked, feats in spawn(_tp_selection, 2, features):
        torch.testing.assert_close(feats, tp1_feats)
        assert picked == tp1


def _chunked_and_whole(rank, world):
    """The tiny MLLM's pool of 16 goes forward whole and in chunks of 4 (no gradients)."""
    from megatron_mllm.data.batch import collate, image_then_text
    from megatron_mllm.data.coreset import CoresetSelector
    from megatron_mllm.data.sampler import VocabParallelReplay
    from megatron_mllm.data.synthetic import samples
    from megatron_mllm.models.config import MLLMConfig
    from megatron_mllm.runtime.assembly.bootstrap import init_rank, seed_model_parallel
    from megatron_mllm.runtime.assembly.model_builder import build_full_model

    init_rank(rank, world, 0, 60.0)
    cfg = MLLMConfig(llm_layers=2)
    torch.manual_seed(0)
    seed_model_parallel(0)
    built = build_full_model(cfg)
    encoder, bb = built.encoders[0], built.backbone
    images, text, source = samples(cfg, list(range(16)))
    batch = image_then_text(images, text, cfg.image_tokens)
    captured = []
    bb.gpt.output_layer.register_forward_pre_hook(lambda m, a: captured.append(a[0].detach()))

    def hidden(b):
        with torch.no_grad():
            bb(None, bb.decoder_input([encoder(b.images)], b), b)
        return captured.pop().transpose(0, 1)

    whole = hidden(batch)
    chunks = [batch.select(list(range(i, i + 4))) for i in range(0, 16, 4)]
    chunked = torch.cat([hidden(c) for c in chunks])
    labels = collate(chunks).labels
    weight = bb.gpt.output_layer.weight.detach()
    out = []
    for h in (whole, chunked):
        replay = VocabParallelReplay()
        feats = CoresetSelector(CoresetConfig(batch_size=8, seed=1)).features(
            replay, h, labels, weight
        )
        selector = CoresetSelector(CoresetConfig(batch_size=8, seed=1))
        out.append((feats, selector.select(source, replay, h, labels, weight).tolist()))
    return whole, chunked, out


def test_chunked_pool_forward_gives_the_features_of_one_pass():
    """The pool's gradient-free forward in chunks of B (its memory B's) gives the output-layer
    inputs, zeroth-order features and selection of one pass over the whole pool."""
    from megatron_mllm.runtime.assembly.launch import spawn

    whole, chunked, ((f1, s1), (f2, s2)) = spawn(_chunked_and_whole, 1)[0]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f2, f1, rtol=1e-3, atol=1e-3)
    assert s1 == s2
