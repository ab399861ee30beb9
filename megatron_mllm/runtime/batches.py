"""The micro-batches of one training step, the same for every run mode."""

from __future__ import annotations

from collections.abc import Callable

from megatron_mllm.data.batch import MicroBatch, image_then_text

_DATASETS: dict[str, object] = {}


def batches(job, step: int) -> Callable[..., MicroBatch]:
    """`get(mb, dp=0)`: micro-batch `mb` of step `step` for DP replica `dp`, from
    `job.data.data_path` shards if given (read once per process), else synthetic. Tensors are on the
    CPU; each run mode moves them to its device."""
    from megatron_mllm.data.synthetic import microbatch

    b, n_mb, dp_size = job.micro_batch, job.num_microbatches, job.backbone.dp
    if not job.data.data_path:

        def synthetic(mb: int, dp: int = 0) -> MicroBatch:
            index = (step * dp_size + dp) * n_mb + mb
            images, text = microbatch(job.cfg, index, b, job.data.seed)
            return image_then_text(images, text, job.cfg.image_tokens)

        return synthetic
    from megatron_mllm.data.webdataset import ImageCaptionShards

    if job.data.data_path not in _DATASETS:
        _DATASETS[job.data.data_path] = ImageCaptionShards(job.data.data_path)
    shards, cfg = _DATASETS[job.data.data_path], job.cfg

    def from_disk(mb: int, dp: int = 0) -> MicroBatch:
        first = ((step * dp_size + dp) * n_mb + mb) * b
        ids = list(range(first, first + b))
        images, text = shards.batch(ids, cfg.image_size, cfg.channels, cfg.text_len, cfg.vocab_size)
        return image_then_text(images, text, cfg.image_tokens)

    return from_disk
