"""Benchmarks and the acceptance-length / speed evaluation."""
