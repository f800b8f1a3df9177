"""Benchmarks that measure what the server adds on top of its parts."""
