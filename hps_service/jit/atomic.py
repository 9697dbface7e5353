"""Atomic loads, fetch-adds and fences on int64 array elements for numba kernels (LLVM atomics).

The L1 cache's arrays may live in memory shared by several processes, so its sequence lock and counters
are array elements, not Python attributes: readers load the sequence with acquire ordering around their
reads, and concurrent readers draw ticks and count LFU touches with atomic fetch-adds (a plain ``+=``
from two threads loses counts).
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _element_pointer(context, builder, array_type, array, index):  # type: ignore[no-untyped-def]
    view = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, view, [index])


@intrinsic
def atomic_load(typingctx, array, index):  # type: ignore[no-untyped-def]
    """``array[index]`` loaded with acquire ordering: later reads are not moved before it (1-D int64 array)."""
    sig = types.int64(array, index)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def atomic_fetch_add(typingctx, array, index, value):  # type: ignore[no-untyped-def]
    """Add ``value`` to ``array[index]`` atomically; returns the value before (1-D int64 array)."""
    sig = types.int64(array, index, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, value, "seq_cst")

    return sig, codegen


@intrinsic
def acquire_fence(typingctx):  # type: ignore[no-untyped-def]
    """Reads before the fence are not moved after the reads that follow it (orders a seqlock's re-check)."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.fence("acquire")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def release_fence(typingctx):  # type: ignore[no-untyped-def]
    """Writes before the fence become visible before the writes after it (orders a seqlock's bumps)."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.fence("release")
        return context.get_dummy_value()

    return sig, codegen


__all__ = ["acquire_fence", "atomic_fetch_add", "atomic_load", "release_fence"]
