"""megatron_mllm: multimodal-LLM training on megatron-core, with encoder work in the bubbles."""

from megatron_mllm.upstream_warnings import quiet_upstream

__version__ = "0.1.0"

quiet_upstream()  # before anything imports megatron-core
