"""Benchmarks (load generator and micro-benchmarks); each prints JSON and is not a timed test."""
