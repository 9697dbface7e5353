"""What the benchmarks stand on: the servers they start, the load generator and its drivers, the reports."""
