"""Each step's micro-batches and their exchange between data-parallel replicas."""
