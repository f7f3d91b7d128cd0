"""Benchmarks: each writes machine-readable JSON and a markdown table."""
