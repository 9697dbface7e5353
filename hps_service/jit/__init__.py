"""Helpers of the numba kernels: one ``mix64`` and the probing arithmetic (``hashing``), atomics, prefetch hints, and the
warm-up that compiles every kernel before a process serves (``warmup``)."""
