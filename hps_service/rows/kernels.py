"""Compiled decoders of stored rows into float32: one per format, each over a whole batch, GIL released.

Stored rows are 4-byte words ``(n, words)``; the decoders read them through views of the same bytes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: 2**112: moves an fp16 exponent (bias 15), placed in a float32's exponent bits, to float32's bias of 127.
_FP16_EXPONENT_SHIFT = np.float32(2.0**112)
#: The least float32 the shift makes of an fp16 infinity or NaN (exponent 31).
_FP16_WAS_INF_NAN = np.float32(65536.0)


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
def decode_fp16(words: np.ndarray, out: np.ndarray) -> None:
    """``words`` (n, ceil(dim/2)) holding IEEE halves -> ``out`` (n, dim) float32, bit-exact with NumPy's conversion
    (subnormals, infinities and NaN payloads included): the half's exponent and mantissa bits placed in a float32
    and scaled by 2**112 (F. Giesen's branch-light conversion; numba has no CPU float16)."""
    half = words.view(np.uint16)
    bits = out.view(np.uint32)
    n, dim = out.shape
    for i in range(n):
        for d in range(dim):
            h = np.uint32(half[i, d])
            bits[i, d] = (h & np.uint32(0x7FFF)) << np.uint32(13)
            value = out[i, d] * _FP16_EXPONENT_SHIFT
            out[i, d] = value
            sign = (h & np.uint32(0x8000)) << np.uint32(16)
            if value >= _FP16_WAS_INF_NAN:
                sign |= np.uint32(0x7F800000)
            bits[i, d] |= sign


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
