"""engine benchmarks."""
