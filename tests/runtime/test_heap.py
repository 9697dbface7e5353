"""The heap trimmer gives freed C heap memory back to the operating system."""

import ctypes
import ctypes.util
import time

import pytest

from hps_service.runtime import heap
from hps_service.runtime.heap import HeapTrimmer, resident_bytes

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

CHUNK = 64 * 1024  # below glibc's initial mmap threshold: served from the heap, whose freed pages stay resident
CHUNKS = 1600  # 100 MiB


@pytest.mark.skipif(not HeapTrimmer(1).supported, reason="the C library has no malloc_trim")
def test_a_trim_returns_freed_heap_pages_that_free_alone_keeps():
    chunks = [libc.malloc(CHUNK) for _ in range(CHUNKS)]
    assert all(chunks)
    for chunk in chunks:
        ctypes.memset(chunk, 1, CHUNK)
    for chunk in chunks[:-1]:  # the last one pins the top of the heap, so free() cannot shrink it
        libc.free(chunk)
    resident = resident_bytes()
    trimmer = HeapTrimmer(30)
    released = trimmer.trim()
    libc.free(chunks[-1])
    assert released >= 80 * 2**20, f"{released / 2**20:.1f} MiB released of ~100 MiB freed"
    assert resident - resident_bytes() >= 80 * 2**20
    assert trimmer.stats.trims == 1 and trimmer.stats.released_bytes == released


def test_the_thread_trims_on_its_interval_and_stops_at_once():
    trimmer = HeapTrimmer(0.05)
    trimmer.start()
    try:
        deadline = 200
        while trimmer.supported and trimmer.stats.trims < 2 and deadline:
            deadline -= 1
            time.sleep(0.05)
    finally:
        trimmer.stop()
    assert not trimmer.supported or trimmer.stats.trims >= 2
    count = trimmer.stats.trims
    time.sleep(0.2)
    assert trimmer.stats.trims == count


def test_interval_zero_never_starts_a_thread():
    trimmer = HeapTrimmer(0)
    trimmer.start()
    assert trimmer._thread is None
    trimmer.stop()


def test_a_watching_trimmer_trims_when_the_figure_falls_and_only_then(monkeypatch):
    """The memtables a flush or a catch-up frees are trimmed at once, not a whole interval later."""
    monkeypatch.setattr(heap, "WATCH_POLL_S", 0.02)
    figure = [100 << 20]
    trimmer = HeapTrimmer(3600)
    trimmer.watch(lambda: figure[0])
    if not trimmer.supported:
        pytest.skip("the C library has no malloc_trim")
    trimmer.start()
    try:
        figure[0] += 50 << 20  # growing memtables: nothing to trim
        time.sleep(0.2)
        figure[0] -= heap.TRIM_ON_FALL_BYTES // 2  # a small fall
        time.sleep(0.2)
        assert trimmer.stats.trims == 0
        figure[0] -= heap.TRIM_ON_FALL_BYTES  # a flush
        deadline = time.monotonic() + 5
        while trimmer.stats.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert trimmer.stats.trims == 1
        time.sleep(0.2)
        assert trimmer.stats.trims == 1
    finally:
        trimmer.stop()


def test_a_failing_figure_is_skipped_and_the_interval_still_trims():
    def broken() -> int:
        raise RuntimeError("the store is being reopened")

    trimmer = HeapTrimmer(0.05)
    trimmer.watch(broken)
    trimmer.start()
    try:
        deadline = time.monotonic() + 10
        while trimmer.supported and trimmer.stats.trims < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        trimmer.stop()
    assert not trimmer.supported or trimmer.stats.trims >= 2
