"""megatron_mllm.training."""
