"""Benchmarks: run by hand (`make bench`), not by the test suite."""
