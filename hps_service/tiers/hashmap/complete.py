"""The complete state of a hash-map table: the hash map provably holds every row the persistent tier stores for it, so
a key it does not hold answers the table's default at once, with no RocksDB read.

The state is one word of the table's control array (``seqlock.CTRL_COMPLETE``), which the lock-free readers (the
node's workers, colocated readers) read inside the same sequence-lock read as the rows (:mod:`.lane`): a reader that
sees the table complete saw, in that same state of the table, that the key was absent. Only the owner writes it:

* :meth:`Completeness.mark` sets it, given the token (:meth:`Completeness.token`) taken before the work that filled
  the table began (a preload, which copies every stored row in), and refuses when anything lost the state since;
* :meth:`Completeness.lose` clears it, inside a sequence-lock write section, before whatever may leave a stored row
  out of the hash map becomes visible: an eviction or a put refused for room (the tier itself), an import, a
  conversion (the engine). Each loss also moves the token, so a fill that began before it can no longer mark the
  table. (Promotions and preloads put under the table's write lock, so they never take a row back out:
  :mod:`hps_service.engine.promote`.)

A new store (a restart) starts every table not complete, until its preload ends.
"""

from __future__ import annotations

import numpy as np

from hps_service.tiers.hashmap import seqlock


class Completeness:
    """The complete state of one table; callers hold the table's lock."""

    def __init__(self, ctrl: np.ndarray) -> None:
        self._ctrl = ctrl
        #: How often the state was lost: the token a mark compares with.
        self.lost = 0

    @property
    def held(self) -> bool:
        """Whether the table is complete now."""
        return bool(self._ctrl[seqlock.CTRL_COMPLETE])

    def token(self) -> int:
        """The losses so far, to hand to :meth:`mark` once the table is filled."""
        return self.lost

    def mark(self, token: int) -> bool:
        """Set the state unless it was lost since ``token``; whether it is set. Rows written before this are visible
        to a reader that sees it (the writes' sequence-lock sections ended first), so no section is needed."""
        if token != self.lost:
            return False
        self._ctrl[seqlock.CTRL_COMPLETE] = 1
        return True

    def lose(self, in_section: bool = False) -> None:
        """Clear the state before the change that breaks it is visible: ``in_section``, inside that change's
        sequence-lock section (an eviction); else in a section of its own, before the change begins."""
        self.lost += 1
        if not self._ctrl[seqlock.CTRL_COMPLETE]:
            return
        if in_section:
            self._ctrl[seqlock.CTRL_COMPLETE] = 0
            return
        seqlock.seq_begin(self._ctrl)
        self._ctrl[seqlock.CTRL_COMPLETE] = 0
        seqlock.seq_end(self._ctrl)
