"""megatron_mllm.models."""
