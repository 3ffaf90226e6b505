"""gpu benchmarks."""
