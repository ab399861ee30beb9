"""megatron_mllm.parallel."""
