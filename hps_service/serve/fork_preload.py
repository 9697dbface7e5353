"""What the node's fork server loads before it forks workers: importing this module imports the worker's code and
runs every warm-up (``hps_service.jit.warmup``, the node's kernels included: numba loads them from its on-disk cache or
compiles them), then freezes the heap. Every worker forked afterwards shares these pages (code, compiled kernels,
module objects) with the fork server and its siblings instead of loading its own copy, and starts serving without a
compile."""

from __future__ import annotations

import atexit
import gc
import os

from hps_service.jit.warmup import warm_all
from hps_service.serve import worker  # noqa: F401  (the worker's imports: gRPC, the engine, the store)

warm_all()
gc.freeze()
# The fork server ends when the owner does (its end of a pipe closes); it then exits at once, without tearing down
# the interpreter, so its workers (SIGKILLed when it dies: prctl PDEATHSIG) stop answering within milliseconds.
# Workers leave through os._exit themselves and never run this.
atexit.register(os._exit, 0)
