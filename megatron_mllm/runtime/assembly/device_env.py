"""The CUDA environment a GPU rank expects, checked without importing torch (the argument
check runs it before anything starts)."""

from __future__ import annotations

import os

# megatron-core schedules its overlapped TP and DP communication for one hardware queue
# (tensor_parallel/layers.py, param_and_grad_buffer.py), and our ordered receives are posted
# lazily so that one queue cannot serialise them into a cycle (runtime/engine/messages.py).
DEVICE_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def device_connections_problem(env=os.environ) -> str | None:
    """One line if CUDA_DEVICE_MAX_CONNECTIONS is set to anything but 1, else None."""
    value = env.get(DEVICE_CONNECTIONS)
    if value is None or value.strip() == "1":
        return None
    return (
        f"{DEVICE_CONNECTIONS}={value}: megatron-core's overlapped communication and this "
        "runtime's message order are scheduled for 1; unset it (it is then set to 1) or set 1"
    )
