"""Compiled decoders of stored rows into float32: one per format, each over a whole batch, GIL released.

Stored rows are 4-byte words ``(n, words)``; the decoders read them through views of the same bytes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: float32 bits of every fp16 bit pattern (numba has no CPU float16, so fp16 decodes through this table).
FP16_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)


@njit(cache=True, nogil=True)
def decode_bf16(words: np.ndarray, out: np.ndarray) -> None:
    """``words`` (n, ceil(dim/2)) holding bf16 pairs -> ``out`` (n, dim) float32: a bf16 is a float32's high half."""
    half = words.view(np.uint16)
    bits = out.view(np.uint32)
    n, dim = out.shape
    for i in range(n):
        for d in range(dim):
            bits[i, d] = np.uint32(half[i, d]) << np.uint32(16)


@njit(cache=True, nogil=True)
def decode_fp16(words: np.ndarray, out: np.ndarray, table: np.ndarray) -> None:
    """``words`` (n, ceil(dim/2)) holding IEEE halves -> ``out`` (n, dim) float32, through ``table`` (FP16_BITS)."""
    half = words.view(np.uint16)
    bits = out.view(np.uint32)
    n, dim = out.shape
    for i in range(n):
        for d in range(dim):
            bits[i, d] = table[half[i, d]]


@njit(cache=True, nogil=True)
def decode_int8(words: np.ndarray, out: np.ndarray) -> None:
    """``words`` (n, ceil(dim/4) + 2): dim uint8 codes, then the row's float32 scale and bias -> ``out`` (n, dim)."""
    codes = words.view(np.uint8)
    n, dim = out.shape
    at = words.shape[1] - 2
    for i in range(n):
        scale = words[i, at]
        bias = words[i, at + 1]
        for d in range(dim):
            out[i, d] = np.float32(codes[i, d]) * scale + bias
