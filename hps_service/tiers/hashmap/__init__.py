"""The in-process volatile tier (``tier``) and its numba kernels, one family per module: the open-addressing index
(``index``), row storage and eviction (``rows``), and the lock-free readers' sequence locks (``seqlock``)."""
