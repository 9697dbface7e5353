"""A row copy for numba kernels as one ``memcpy``: a compiled loop over a row's elements inside a pipelined probe
loop runs several times slower than the C library's copy (measured with loadtest/benchmarks/cache.py's arrays)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.core.typing.templates import Signature
from numba.extending import intrinsic, overload

from hps_service.jit.atomic import IR, Index, Lowering


def _memcpy_row(typingctx: object, dst: types.Array, i: types.Integer, src: types.Array,
                j: types.Integer) -> Lowering:
    """``copy_row`` for 2-D C-contiguous arrays of one dtype: one ``memcpy`` of the narrower width."""
    sig = types.void(dst, i, src, j)

    def codegen(context: IR, builder: IR, signature: Signature, args: Sequence[IR]) -> IR:
        dst_type, _, src_type, _ = signature.args
        dst_view = context.make_array(dst_type)(context, builder, args[0])
        src_view = context.make_array(src_type)(context, builder, args[2])
        zero = context.get_constant(types.intp, 0)
        to = cgutils.get_item_pointer(context, builder, dst_type, dst_view, [args[1], zero])
        at = cgutils.get_item_pointer(context, builder, src_type, src_view, [args[3], zero])
        dst_cols = cgutils.unpack_tuple(builder, dst_view.shape, 2)[1]
        src_cols = cgutils.unpack_tuple(builder, src_view.shape, 2)[1]
        cols = builder.select(builder.icmp_signed("<", dst_cols, src_cols), dst_cols, src_cols)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(src_type.dtype)))
        byte_pointer = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.bitcast(to, byte_pointer), builder.bitcast(at, byte_pointer),
                           builder.mul(cols, itemsize), 1)
        return context.get_dummy_value()

    return sig, codegen


#: As jitted code calls it (numba passes the typing context: see :mod:`hps_service.jit.atomic`).
_memcpy = cast(Callable[[np.ndarray, Index, np.ndarray, Index], None], intrinsic(_memcpy_row))


def copy_row(dst: np.ndarray, i: Index, src: np.ndarray, j: Index) -> None:
    """``dst[i] = src[j]`` over the narrower of the two widths (2-D arrays of one dtype)."""
    cols = min(dst.shape[1], src.shape[1])
    dst[i, :cols] = src[j, :cols]


@overload(copy_row, inline="always")
def _copy_row_compiled(dst: Any, i: Any, src: Any, j: Any) -> Callable[..., None]:
    """In kernels: one ``memcpy`` where both arrays are C-contiguous, else an element loop (numba wants the
    parameters of the typing and the implementations alike, annotations included: Any)."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.ndim == src.ndim == 2
            and dst.dtype == src.dtype):
        raise TypingError("copy_row takes two 2-D arrays of one dtype")
    if dst.layout == src.layout == "C":
        def contiguous(dst: Any, i: Any, src: Any, j: Any) -> None:
            _memcpy(dst, i, src, j)
        return contiguous

    def strided(dst: Any, i: Any, src: Any, j: Any) -> None:
        for d in range(min(dst.shape[1], src.shape[1])):
            dst[i, d] = src[j, d]
    return strided
