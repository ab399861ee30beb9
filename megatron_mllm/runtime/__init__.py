"""megatron_mllm.runtime."""
