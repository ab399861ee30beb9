"""Data only the benchmarks train on (the coreset benchmark's mixture and digit shards)."""
