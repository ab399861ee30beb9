"""megatron_mllm.data."""
