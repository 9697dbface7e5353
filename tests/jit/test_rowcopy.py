"""The row copy of kernels, compiled (a memcpy for C-contiguous arrays, a loop for strided ones) and in Python:
exactly one row, the narrower width, any dtype; refused for arrays of two dtypes."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba.core.errors import TypingError

from hps_service.jit.rowcopy import copy_row


@numba.njit(cache=False)
def _copy(dst: np.ndarray, i: int, src: np.ndarray, j: int) -> None:
    copy_row(dst, i, src, j)


@pytest.mark.parametrize("how", ["memcpy", "strided", "python"])
@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.int64])
@pytest.mark.parametrize(("dst_cols", "src_cols"), [(5, 5), (3, 5), (5, 3)])
def test_copies_one_row_of_the_narrower_width_and_nothing_else(how: str, dtype: type, dst_cols: int,
                                                               src_cols: int) -> None:
    src: np.ndarray = np.arange(8 * src_cols).astype(dtype).reshape(4, 2 * src_cols)
    src = src[:, ::2] if how == "strided" else np.ascontiguousarray(src[:, :src_cols])
    dst: np.ndarray = np.full((3, dst_cols), 99, dtype=dtype)
    (copy_row if how == "python" else _copy)(dst, 1, src, 2)
    width = min(dst_cols, src_cols)
    want: np.ndarray = np.full((3, dst_cols), 99, dtype=dtype)
    want[1, :width] = src[2, :width]
    assert np.array_equal(dst, want)


def test_refuses_arrays_of_two_dtypes_or_not_of_rows() -> None:
    with pytest.raises(TypingError):
        _copy(np.zeros((2, 2), np.float32), 0, np.zeros((2, 2), np.float64), 0)
    with pytest.raises(TypingError):
        _copy(np.zeros((2, 2), np.float32), 0, np.zeros(4, np.float32), 0)
