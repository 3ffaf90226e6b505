"""peers benchmarks."""
