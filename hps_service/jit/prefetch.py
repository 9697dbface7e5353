"""A software prefetch hint for numba kernels: lets the cache misses of different keys in a batch overlap."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.typing.templates import Signature
from numba.extending import intrinsic

from hps_service.jit.atomic import IR, Index, Lowering


def _prefetch(typingctx: object, array: types.Array, row: types.Integer, col: types.Integer) -> Lowering:
    """Hint the CPU to load the cache line holding ``array[row, col]`` (LLVM prefetch; no effect on results)."""
    sig = types.void(array, row, col)

    def codegen(context: IR, builder: IR, signature: Signature, args: Sequence[IR]) -> IR:
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        indices = [args[1], args[2]][: array_type.ndim]
        address = cgutils.get_item_pointer(context, builder, array_type, view, indices)
        byte_pointer = builder.bitcast(address, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn_type = ir.FunctionType(ir.VoidType(), [byte_pointer.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fn_type, "llvm.prefetch.p0")
        builder.call(fn, [byte_pointer, i32(0), i32(3), i32(1)])  # read, keep in all cache levels, data
        return context.get_dummy_value()

    return sig, codegen


#: As jitted kernels call it (numba passes the typing context: see :mod:`hps_service.jit.atomic`).
prefetch = cast(Callable[[np.ndarray, Index, Index], None], intrinsic(_prefetch))
