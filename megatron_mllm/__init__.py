"""megatron_mllm: multimodal-LLM training on megatron-core, with encoder work in the bubbles."""

__version__ = "0.1.0"
