"""CuPy RawKernel for the query of the set-associative cache: one warp per key probes and copies.

The 32 lanes of a warp compare up to 32 ways of the key's set at once (a ballot finds the first
match), then copy the row with the lanes striding over ``dim``; lane 0 touches the slot clock. The
set mapping is the same splitmix64 + multiply-shift as :func:`hps_service.cache.set_assoc.set_index`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

_SOURCE = r"""
extern "C" __device__ __forceinline__ long long hps_set_of(unsigned long long x, unsigned long long sets) {
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27; x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return (long long)(((x >> 32) * sets) >> 32);
}

extern "C" __global__ void hps_cache_query(
    const unsigned long long* __restrict__ table, long long* __restrict__ clock,
    const float* __restrict__ values, const unsigned long long* __restrict__ keys,
    float* __restrict__ out, unsigned char* __restrict__ hit,
    const long long n, const long long sets, const int ways, const int dim,
    const long long tick, const int lfu)
{
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= n) return;  /* uniform per warp: blockDim.x is a multiple of 32 */
    const unsigned long long key = keys[warp];
    const long long s = hps_set_of(key, (unsigned long long)sets);
    const unsigned long long* row = table + s * ways;
    int found = -1;
    for (int base = 0; base < ways; base += 32) {
        const int w = base + lane;
        const bool match = (w < ways) && (row[w] == key);
        const unsigned int ballot = __ballot_sync(0xffffffffu, match);
        if (ballot) { found = base + __ffs(ballot) - 1; break; }
    }
    if (found < 0) {
        if (lane == 0) hit[warp] = 0;
        return;
    }
    const long long slot = s * ways + found;
    const float* src = values + slot * (long long)dim;
    float* dst = out + warp * (long long)dim;
    for (int d = lane; d < dim; d += 32) dst[d] = src[d];
    if (lane == 0) {
        hit[warp] = 1;
        if (lfu) atomicAdd((unsigned long long*)(clock + slot), 1ULL);
        else clock[slot] = tick;
    }
}
"""

_THREADS = 256


class CudaProbe:
    """Compiles the query kernel once per process and launches it on CuPy arrays."""

    _kernel_cache: ClassVar[dict[int, Any]] = {}

    def __init__(self, cp: ModuleType) -> None:
        self.cp = cp
        device = int(cp.cuda.runtime.getDevice())
        if device not in self._kernel_cache:
            self._kernel_cache[device] = cp.RawKernel(_SOURCE, "hps_cache_query")
        self.kernel = self._kernel_cache[device]

    def query(self, table: Any, clock: Any, values: Any, keys: Any, out: Any, tick: int, lfu: bool) -> Any:
        """Probe ``keys`` (int64 device array), copy hits into ``out``; returns the bool hit mask."""
        cp = self.cp
        n = int(keys.shape[0])
        hit = cp.zeros(n, dtype=cp.uint8)
        if n:
            keys_u = cp.ascontiguousarray(keys).view(cp.uint64)
            blocks = (n * 32 + _THREADS - 1) // _THREADS
            sets, ways = int(table.shape[0]), int(table.shape[1])
            self.kernel(
                (blocks,), (_THREADS,),
                (table.view(cp.uint64), clock, values, keys_u, out, hit,
                 cp.int64(n), cp.int64(sets), cp.int32(ways), cp.int32(values.shape[1]),
                 cp.int64(tick), cp.int32(1 if lfu else 0)),
            )
        return hit.view(cp.bool_)
