"""How much memory the node's shared store really holds: the pages its files have on the memory-backed filesystem
(a file's allocated blocks, not its size: the hash map's and L1's files are sparse until rows arrive)."""

from __future__ import annotations

import os
from pathlib import Path


def resident_bytes(path: Path) -> int:
    """Bytes allocated to the files under ``path`` (0 when it is gone); they count against the pod's memory."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # a file replaced while walking (a manifest)
                continue
    return total
