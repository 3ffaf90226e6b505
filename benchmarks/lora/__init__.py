"""lora benchmarks."""
