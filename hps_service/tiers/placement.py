"""Where an in-process tier's arrays go: a node's shared store, so that the node's workers map the owner's rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hps_service.shm.region import NamedAllocator

#: ``release(name)``: give back an array the allocator made (unlinks a shared file; nothing for private memory).
Release = Callable[[str], None]


@dataclass
class Placement:
    """``alloc(name, shape, dtype)`` places an array, ``release(name)`` gives it back; ``lfu``: the tier placed
    evicts by use counts, which its readers' stamps follow (set by the backend that opens the tier)."""

    alloc: NamedAllocator
    release: Release
    lfu: bool = False
