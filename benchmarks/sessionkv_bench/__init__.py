"""What the benchmarks share: statistics (one percentile definition), ..."""
