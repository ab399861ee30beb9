"""The coreset benchmark's tasks: a model, its training examples by index, their sources, and
a held-out evaluation (overall and per source).

* `gpt_task`: a megatron-core GPT on a text mixture (`bench_data.mixture`; the skewed one by
  default: one big source, seven small).
* `llava_task`: the tiny MLLM (ViT + projector + GPT from megatron-core parts) on LLaVA-format
  digit conversations, encoded by the training path's own encoder.
* `mllm_task`: the tiny MLLM captioning scikit-learn's digits (sources = the ten classes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Task:
    """What the training loop needs from a task: examples by index into one list."""

    n_train: int
    sources: Any  # [n_train] source id per training example
    new_model: Any  # seed -> model
    loss_of: Any  # (model, idx) -> mean training loss (with graph)
    evaluate: Any  # model -> held-out metrics
    hidden_of: Any  # (model, idx) -> (output-layer inputs [n, s, h], labels [n, s]), no graph
    weight_of: Any  # model -> output-layer weight [V, h]
    describe: str
    names: list[str]  # source names by id


def per_example_stats(logits, labels):
    """Per example: mean next-token loss over labelled positions and exact answer match."""
    import torch.nn.functional as F

    keep = labels != -100
    ce = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    loss = (ce * keep).sum(1) / keep.sum(1).clamp(min=1)
    exact = ((logits.argmax(-1) == labels) | ~keep).all(1).float()
    return loss, exact


def held_out_metrics(loss, exact, source, num_sources: int) -> dict:
    """Overall (every held-out example alike) and per source: loss and exact-answer accuracy."""
    by = [(float(loss[source == c].mean()), float(exact[source == c].mean()))
          for c in range(num_sources) if (source == c).any()]  # fmt: skip
    return {
        "heldout_loss": float(loss.mean()),
        "worst_source_loss": max(b[0] for b in by),
        "heldout_accuracy": float(exact.mean()),
        "worst_source_accuracy": min(b[1] for b in by),
        "source_loss": [b[0] for b in by],
        "source_accuracy": [b[1] for b in by],
    }


def majority_accuracy(tokens, answer_mask, source) -> float:
    """Held-out exact-answer accuracy of always giving each source's most common answer: the
    level of a model that learned nothing but the answers' frequencies."""
    from collections import Counter

    hits = 0
    for c in source.unique().tolist():
        rows = (source == c).nonzero().flatten().tolist()
        answers = Counter(tuple(tokens[r, 1:][answer_mask[r, :-1]].tolist()) for r in rows)
        hits += answers.most_common(1)[0][1]
    return hits / len(source)


def mllm_config(args, **kw):
    from megatron_mllm.models.config import MLLMConfig

    if args.size == "wide":
        kw.update(llm_layers=4, llm_hidden=256, llm_heads=8, vit_hidden=128)
    else:
        kw.update(llm_layers=2)
    return MLLMConfig(**kw)


def tiny_mllm(cfg):
    """ViT + projector + GPT from megatron-core parts, one process; forward(batch) -> logits
    [b, s, V], with the output layer's input captured when asked."""
    import torch

    from megatron_mllm.runtime.assembly.model_builder import build_full_model

    class TinyMLLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            built = build_full_model(cfg)
            self.encoder, self.backbone = built.encoders[0], built.backbone

        def forward(self, batch):
            bb = self.backbone
            return bb(None, bb.decoder_input([self.encoder(batch.images)], batch), batch)

        def hidden(self, batch):
            captured = []
            out = self.backbone.gpt.output_layer
            handle = out.register_forward_pre_hook(
                lambda m, a: captured.append(a[0].transpose(0, 1).detach())
            )
            try:
                self(batch)
            finally:
                handle.remove()
            return captured[0]

    return TinyMLLM


def batch_task(args, cfg, batches, source, held, describe: str, names: list[str]) -> Task:
    """A Task over one-sample MicroBatches `batches` (the held-out ones at indices `held`)."""
    import torch

    from megatron_mllm.data.batch import collate
    from megatron_mllm.runtime.assembly.bootstrap import seed_model_parallel

    model_class = tiny_mllm(cfg)
    held_set = set(held.tolist())
    train_rows = [i for i in range(len(batches)) if i not in held_set]
    train = [batches[i] for i in train_rows]

    def new_model(seed):
        torch.manual_seed(seed)
        seed_model_parallel(seed)
        return model_class()

    def loss_of(model, idx):
        batch = collate([train[i] for i in idx.tolist()])
        return per_example_stats(model(batch), batch.labels)[0].mean()

    @torch.no_grad()
    def evaluate(model):
        batch = collate([batches[i] for i in held.tolist()])
        loss, exact = per_example_stats(model(batch), batch.labels)
        return held_out_metrics(loss, exact, source[held], int(source.max()) + 1)

    def hidden_of(model, idx):
        batch = collate([train[i] for i in idx.tolist()])
        return model.hidden(batch), batch.labels

    return Task(
        len(train),
        source[train_rows],
        new_model,
        loss_of,
        evaluate,
        hidden_of,
        lambda model: model.backbone.gpt.output_layer.weight.detach(),
        describe,
        names,
    )


def llava_task(args) -> Task:
    """LLaVA-format digit conversations (four sources), encoded as training encodes them."""
    import tempfile
    from pathlib import Path

    import torch

    from megatron_mllm.data.llava import load_raw, read_records
    from megatron_mllm.data.llava_digits import conversation_texts, write_llava_digits
    from megatron_mllm.data.task_encoder import EncodeSpec, encode_record
    from megatron_mllm.data.tokenizer import load_tokenizer, train_tiny_tokenizer

    seq = 48
    with tempfile.TemporaryDirectory() as tmp:
        json_path = write_llava_digits(Path(tmp) / "src", args.examples)
        train_tiny_tokenizer(conversation_texts(json_path), Path(tmp) / "tok", 300)
        tokenizer = load_tokenizer(Path(tmp) / "tok")
        names = [r["source"] for r in load_raw(json_path)]
        records = read_records(json_path)
        folder = Path(json_path).parent / "images"
        probe = mllm_config(args)
        vocab = -(-len(tokenizer) // 128) * 128
        cfg = mllm_config(args, vocab_size=vocab, text_len=seq - probe.image_tokens)
        spec = EncodeSpec(tokenizer, seq, cfg.image_tokens, cfg.image_size)
        batches = [
            encode_record(r, [(folder / name).read_bytes() for name in r.images], spec)
            for r in records
        ]
    kinds = sorted(set(names))
    source = torch.tensor([kinds.index(n) for n in names])
    g = torch.Generator().manual_seed(0)
    held = torch.cat([
        (source == c).nonzero().squeeze(1)[torch.randperm(int((source == c).sum()), generator=g)][
            : args.held_out
        ]
        for c in range(len(kinds))
    ])  # fmt: skip
    describe = (
        f"LLaVA-format digit conversations ({', '.join(kinds)}), {len(batches) - len(held)} "
        f"training, {len(held)} held out; sequence {seq}, vocabulary {vocab}"
    )
    return batch_task(args, cfg, batches, source, held, describe, kinds)


def mllm_task(args) -> Task:
    """The tiny MLLM captioning scikit-learn's digits; source = digit class, ~1 / (class + 1)."""
    import tempfile

    import torch

    from megatron_mllm.data.batch import image_then_text

    from .digit_shards import ImageCaptionShards, write_digit_shards

    cfg = mllm_config(args, text_len=20)
    with tempfile.TemporaryDirectory() as tmp:
        write_digit_shards(tmp, energon=False)
        data = ImageCaptionShards(tmp)
    words = "zero one two three four five six seven eight nine".split()
    label = torch.tensor([words.index(c.split()[-1]) for c in data.captions])
    g = torch.Generator().manual_seed(0)
    keep, held = [], []
    for c in range(10):
        rows = (label == c).nonzero().squeeze(1)
        rows = rows[torch.randperm(len(rows), generator=g)]
        held += rows[: args.held_out].tolist()
        rest = rows[args.held_out :]
        keep += rest[: max(8, len(rest) // (c + 1))].tolist()  # a few big, several small
    rows = keep + held
    images, text = data.batch(rows, cfg.image_size, cfg.channels, cfg.text_len, cfg.vocab_size)
    batches = [
        image_then_text(images[i : i + 1], text[i : i + 1], cfg.num_patches)
        for i in range(len(rows))
    ]
    held_idx = torch.arange(len(keep), len(rows))
    describe = f"digit captions, 10 classes, {len(keep)} training, {len(held)} held out"
    return batch_task(args, cfg, batches, label[rows], held_idx, describe, words)


def gpt_task(args) -> Task:
    """A megatron-core GPT (hidden 128 at the tiny size) on a text mixture: `--mixture skewed`
    (one big source, seven small) or `math` (math topics + digit captions)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_mllm.data.batch import IGNORE_INDEX
    from megatron_mllm.models.config import transformer_config
    from megatron_mllm.models.stages import causal_mask
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.bootstrap import seed_model_parallel

    from .mixture import DEFAULT_SOURCES, SKEWED_SOURCES, VOCAB, build_mixture

    one = ParallelPlan(1, 1, 1)
    groups = build_colocated_groups(one, one, 1, 0)
    sources = SKEWED_SOURCES if args.mixture == "skewed" else DEFAULT_SOURCES
    seq = 16 if args.mixture == "skewed" else 32
    train, held = build_mixture(
        args.examples, seed=0, seq_len=seq, sources=sources, heldout_per_source=args.held_out
    )
    mask, pos = causal_mask(seq), torch.arange(seq).unsqueeze(0)
    cfg = mllm_config(args, vocab_size=len(VOCAB), llm_hidden=128)

    def labels_of(data, idx):
        labels = torch.full_like(data.tokens[idx], IGNORE_INDEX)
        answer = data.answer_mask[idx][:, :-1].bool()
        labels[:, :-1] = torch.where(answer, data.tokens[idx][:, 1:], IGNORE_INDEX)
        return labels

    def new_model(seed):
        torch.manual_seed(seed)
        seed_model_parallel(seed)
        return GPTModel(
            transformer_config(cfg, "llm", 1, 1),
            get_gpt_layer_local_spec(),
            len(VOCAB),
            seq,
            pg_collection=groups.backbone,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )

    def logits(model, tokens):
        return model(tokens, pos.expand(tokens.shape[0], -1), mask)

    def loss_of(model, idx):
        return per_example_stats(logits(model, train.tokens[idx]), labels_of(train, idx))[0].mean()

    @torch.no_grad()
    def evaluate(model):
        every = torch.arange(len(held.tokens))
        loss, exact = per_example_stats(logits(model, held.tokens), labels_of(held, every))
        return held_out_metrics(loss, exact, held.source, len(held.names))

    def hidden_of(model, idx):
        captured = []
        handle = model.output_layer.register_forward_pre_hook(
            lambda m, a: captured.append(a[0].transpose(0, 1).detach())
        )
        try:
            logits(model, train.tokens[idx])
        finally:
            handle.remove()
        return captured[0], labels_of(train, idx)

    sizes = torch.bincount(train.source).tolist()
    chance = majority_accuracy(held.tokens, held.answer_mask, held.source)
    describe = (
        f"{args.mixture} mixture, {len(sizes)} sources of {max(sizes)} down to {min(sizes)} "
        f"training examples ({', '.join(train.names)}), {len(held.tokens)} held out (accuracy "
        f"of each source's most common answer: {chance:.3f})"
    )
    return Task(
        len(train.tokens),
        train.source,
        new_model,
        loss_of,
        evaluate,
        hidden_of,
        lambda model: model.output_layer.weight.detach(),
        describe,
        train.names,
    )


TASKS = {"gpt": gpt_task, "llava": llava_task, "mllm": mllm_task}
