"""Benchmarks: decode speed vs transformers, server load, training throughput (`make bench`)."""
