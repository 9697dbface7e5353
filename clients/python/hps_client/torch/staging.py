"""Where looked-up rows land: on the CPU straight into the output tensor (the client writes them there); on a CUDA
device through a pinned host buffer reused from call to call and copied to the device asynchronously, never a
fresh pageable copy per call; on another accelerator through a host tensor moved with ``.to``."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

#: Writes the rows into a C-contiguous float32 ``(n, dim)`` array.
Fill = Callable[[np.ndarray], None]


class _Pinned:
    """One pinned host buffer and the event after which the copy out of it is done (None: free now)."""

    def __init__(self, numel: int) -> None:
        self.tensor = torch.empty(numel, dtype=torch.float32, pin_memory=True)
        self.event: Any = None

    @property
    def capacity(self) -> int:
        return int(self.tensor.numel())

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


class HostStaging:
    """A few pinned host buffers (``keep``), each reused once the device copy out of it has finished: a call and a
    prefetch in flight at once each hold one."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._buffers: deque[_Pinned] = deque()
        self._lock = threading.Lock()
        #: Pinned buffers allocated so far (reuse keeps this at the number of calls in flight at once).
        self.allocated = 0

    def acquire(self, numel: int) -> _Pinned:
        """A buffer of at least ``numel`` floats no copy is reading; the oldest one waited for when ``keep`` are
        in use, a larger one allocated (a power of two) when none is large enough."""
        with self._lock:
            for i, buf in enumerate(self._buffers):
                if buf.capacity >= numel and buf.ready():
                    del self._buffers[i]
                    return buf
            if len(self._buffers) >= self.keep:
                oldest = self._buffers.popleft()
                if oldest.event is not None:
                    oldest.event.synchronize()
                if oldest.capacity >= numel:
                    return oldest
            self.allocated += 1
            return _Pinned(1 << max(10, math.ceil(math.log2(max(numel, 1)))))

    def release(self, buf: _Pinned, event: Any) -> None:
        """Give ``buf`` back; reusable once ``event`` (recorded after the copy out of it) has completed."""
        buf.event = event
        with self._lock:
            self._buffers.append(buf)


def rows_on(device: torch.device, shape: Sequence[int], fill: Fill, staging: HostStaging) -> torch.Tensor:
    """A float32 tensor of ``shape`` (``(..., dim)``) on ``device`` holding the rows ``fill`` writes."""
    dim = int(shape[-1])
    n = math.prod(shape[:-1])
    if device.type == "cpu":
        out = torch.empty(tuple(shape), dtype=torch.float32)
        if n and dim:
            fill(out.numpy().reshape(n, dim))
        return out
    if device.type != "cuda":
        host = torch.zeros(tuple(shape), dtype=torch.float32)
        if n and dim:
            fill(host.numpy().reshape(n, dim))
        return host.to(device)
    out = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    if not (n and dim):
        return out
    buf = staging.acquire(n * dim)
    host = buf.tensor[: n * dim]
    fill(host.numpy().reshape(n, dim))
    out.copy_(host.view(tuple(shape)), non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    staging.release(buf, event)
    return out
