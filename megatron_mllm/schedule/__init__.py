"""megatron_mllm.schedule."""
