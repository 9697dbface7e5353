"""The persistent tier on RocksDB (``tier``): its open (``opening``), write batches (``staging``), flushes (``flush``),
whole-file operations (``files``), recovery after a failed write (``recovery``), options and reserved column families."""
