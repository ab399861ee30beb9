"""The one place that silences upstream warnings we cannot act on (megatron-core's import-time
notes about missing Transformer Engine and Apex, its own deprecated defaults, torch names it
still calls). What they would have said that matters is said once, at start-up, by
`fallbacks()`."""

from __future__ import annotations

import importlib.util
import warnings

UPSTREAM = (
    r".*Transformer Engine and Apex are not installed.*",  # eight times per process
    r".*Apex is not installed\. Falling back to Torch Norm.*",  # three more
    r".*full scope is deprecated.*",  # megatron-core's own default cuda_graph_scope
    r".*`load_state_dict` is deprecated.*",  # inside megatron-core's dist_checkpointing
    r".*(all_gather_into_tensor|reduce_scatter_tensor).*",  # torch names megatron-core calls
    r".*'pin_memory' argument is set as true.*",  # energon's loader on a machine without CUDA
)


def quiet_upstream() -> None:
    """Ignore UPSTREAM's warnings in this process (and the processes forked from it)."""
    for message in UPSTREAM:
        warnings.filterwarnings("ignore", message=message)


def fallbacks() -> str:
    """Which optional upstream libraries are missing and what runs instead, in one line."""
    missing = []
    if importlib.util.find_spec("transformer_engine") is None:
        missing.append("Transformer Engine (megatron-core's local layers)")
    if importlib.util.find_spec("apex") is None:
        missing.append("Apex (torch's optimizers, megatron-core's local multi-tensor kernels)")
    return "not installed: " + "; ".join(missing) if missing else "Transformer Engine and Apex"
