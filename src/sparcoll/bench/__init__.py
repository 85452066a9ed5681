"""Benchmark support code (emulated networks, measurement helpers)."""
