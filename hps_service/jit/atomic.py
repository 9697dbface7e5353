"""Atomic loads, fetch-adds and fences on integer array elements for numba kernels (LLVM atomics).

The L1 cache's arrays may live in memory shared by several processes, so its sequence lock and counters
are array elements, not Python attributes: readers load the sequence with acquire ordering around their
reads, and concurrent readers draw ticks and count LFU touches with atomic fetch-adds (a plain ``+=``
from two threads loses counts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.typing.templates import Signature
from numba.extending import intrinsic

#: llvmlite's IR builder, values and numba's lowering context: untyped libraries, so Any.
IR = Any
#: What an intrinsic's typing returns: its signature and the function that emits its LLVM IR.
Lowering = tuple[Signature, Callable[[IR, IR, Signature, Sequence[IR]], IR]]
#: An array index as kernels pass it (a Python int or a NumPy integer).
Index = int | np.integer[Any]


def _element_pointer(context: IR, builder: IR, array_type: types.Array, array: IR, index: IR) -> IR:
    view = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, view, [index])


def _atomic_load(typingctx: object, array: types.Array, index: types.Integer) -> Lowering:
    """``array[index]`` loaded with acquire ordering: later reads are not moved before it (1-D int64 array)."""
    sig = types.int64(array, index)

    def codegen(context: IR, builder: IR, signature: Signature, args: Sequence[IR]) -> IR:
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


def _atomic_fetch_add(typingctx: object, array: types.Array, index: types.Integer, value: types.Integer) -> Lowering:
    """Add ``value`` to ``array[index]`` atomically; returns the value before (1-D int64 or int32 array)."""
    elem = array.dtype
    sig = elem(array, index, value)

    def codegen(context: IR, builder: IR, signature: Signature, args: Sequence[IR]) -> IR:
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        value = context.cast(builder, args[2], signature.args[2], elem)
        return builder.atomic_rmw("add", ptr, value, "seq_cst")

    return sig, codegen


def _acquire_fence(typingctx: object) -> Lowering:
    """Reads before the fence are not moved after the reads that follow it (orders a seqlock's re-check)."""
    sig = types.void()

    def codegen(context: IR, builder: IR, signature: Signature, args: Sequence[IR]) -> IR:
        builder.fence("acquire")
        return context.get_dummy_value()

    return sig, codegen


def _release_fence(typingctx: object) -> Lowering:
    """Writes before the fence become visible before the writes after it (orders a seqlock's bumps)."""
    sig = types.void()

    def codegen(context: IR, builder: IR, signature: Signature, args: Sequence[IR]) -> IR:
        builder.fence("release")
        return context.get_dummy_value()

    return sig, codegen


# The intrinsics as jitted kernels call them: numba passes the typing context, so the caller's signature is the
# typing function's without it (numba's stubs type an intrinsic's call with the typing function's own signature).
atomic_load = cast(Callable[[np.ndarray, Index], np.int64], intrinsic(_atomic_load))
atomic_fetch_add = cast(Callable[[np.ndarray, Index, Index], np.int64], intrinsic(_atomic_fetch_add))
acquire_fence = cast(Callable[[], None], intrinsic(_acquire_fence))
release_fence = cast(Callable[[], None], intrinsic(_release_fence))

__all__ = ["acquire_fence", "atomic_fetch_add", "atomic_load", "release_fence"]
