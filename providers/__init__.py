"""Upstream clients and pools, and the simulated upstream used by tests, demo and benchmarks."""
