"""Parallelism: compressed pipeline boundaries and tensor-parallel styles."""
