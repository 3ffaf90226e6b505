"""serve benchmarks."""
