"""L1 embedding cache: set-associative, one code path for NumPy and CuPy."""
