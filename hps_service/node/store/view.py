"""A reader's side of the shared store: maps one generation, follows its manifest, tells when it is gone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hps_service.config.base import Storage
from hps_service.errors import UnavailableError
from hps_service.node.store import layout
from hps_service.node.store.node_store import T_CHANGES
from hps_service.shm.changes import ChangeRing
from hps_service.shm.queue import Ring
from hps_service.shm.region import Region, open_spec
from hps_service.tiers.hashmap import layout as hashmap
from hps_service.tiers.hashmap import seqlock as hk
from hps_service.tiers.hashmap.reader import TableArrays, TableReader
from hps_service.tiers.hashmap.stamps import stamp_halves


@dataclass
class TableView:
    """One served table as a reader maps it."""

    serial: int
    model: str
    table: str
    dim: int
    default: Any
    control: np.ndarray
    changes: ChangeRing
    counters: np.ndarray | None
    l1: dict[str, np.ndarray] | None
    storage: Storage = "fp32"
    #: The tier id of its rows ("": ``model.table``; a converted table's is another).
    stored_as: str = ""


class StoreView:
    """One generation of a store, mapped read-only (colocated clients) or read-write (the node's workers, which
    write their own counters, queues and the hash map's reader stamps, never the rows)."""

    def __init__(self, path: Path, *, writable: bool) -> None:
        self.path = Path(path)
        self.writable = writable
        self.region = Region(self.path, writable=writable)
        try:
            self.header = self.region.open(layout.HEADER, (layout.HEADER_LEN,), np.int64, writable=False)
        except PermissionError:
            raise PermissionError(f"not allowed to map the store at {self.path} (mode 0640: the server's user and "
                                  f"group only)") from None
        if int(self.header[layout.H_MAGIC]) != layout.MAGIC or int(self.header[layout.H_LAYOUT]) != \
                layout.LAYOUT_VERSION:
            raise UnavailableError(f"{self.path} is not an hps store of layout {layout.LAYOUT_VERSION}")
        self.generation = int(self.header[layout.H_GENERATION])
        #: The header as Python ints by index (a memoryview reads one in half the time of ``header.item``), for the
        #: checks a colocated reader makes on every call.
        self.header_words = self.header.data
        self.manifest: dict[str, Any] = {}
        self.manifest_gen = -1
        self._tables: dict[int, TableView] = {}
        self._volatile: dict[str, tuple[str, TableReader]] = {}  # table id -> (prefix of its arrays, reader)
        self.reload()

    @classmethod
    def attach(cls, root: Path, *, writable: bool) -> StoreView:
        """The live generation under ``root`` (UnavailableError when there is none or its owner is gone)."""
        gen = layout.current_generation(Path(root))
        if gen is None or not (gen / layout.HEADER).exists():
            raise UnavailableError(f"no store at {root} (is the server running with server.local enabled?)")
        view = cls(gen, writable=writable)
        if not view.live():
            raise UnavailableError(f"the store at {gen} belongs to a server that is no longer running")
        return view

    # ---- liveness -----------------------------------------------------------------------------
    def state(self) -> int:
        return int(self.header[layout.H_STATE])

    def live(self) -> bool:
        """The owner still holds this generation (not closed, its lock held)."""
        return self.state() != layout.CLOSED and layout.owner_alive(self.path / layout.LOCK)

    def changed(self) -> bool:
        """The owner published a new manifest since :meth:`reload`."""
        return bool(self.header_words[layout.H_MANIFEST] != self.manifest_gen)

    def reload(self) -> None:
        """Read the current manifest (tables no longer in it are dropped, new ones mapped when first used)."""
        gen = int(self.header[layout.H_MANIFEST])
        try:
            manifest = json.loads((self.path / layout.MANIFEST).read_text())
        except FileNotFoundError:
            raise UnavailableError(f"the store at {self.path} has no manifest (its server stopped)") from None
        self.manifest = manifest
        self.manifest_gen = gen
        keep = {int(s) for s in manifest["tables"]}
        self._tables = {s: v for s, v in self._tables.items() if s in keep}
        vol = manifest["volatile"]["tables"]
        # a reader is kept while its arrays are the table's: a table created again under a dropped one's id (its
        # arrays elsewhere) is mapped afresh, and a dropped one's mapping goes with its last reader
        self._volatile = {t: held for t, held in self._volatile.items() if vol.get(t, {}).get("prefix") == held[0]}

    # ---- tables -------------------------------------------------------------------------------
    def served(self, model: str, table: str) -> int | None:
        """The serial of a served table, or None."""
        serial = self.manifest["served"].get(model, {}).get(table)
        return None if serial is None else int(serial)

    def table(self, serial: int) -> TableView:
        view = self._tables.get(serial)
        if view is None:
            entry = self.manifest["tables"][str(serial)]
            control = open_spec(self.region, entry["control"], writable=False)
            ring = open_spec(self.region, entry["changes"], writable=False)
            counters = open_spec(self.region, entry["counters"]) if self.writable else None
            l1 = None
            if entry.get("l1"):
                l1 = {name: open_spec(self.region, spec, writable=self.writable and name in entry["l1"]["writable"])
                      for name, spec in entry["l1"]["arrays"].items()}
            view = TableView(serial, entry["model"], entry["table"], int(entry["dim"]), entry["default"], control,
                             ChangeRing(ring, control, T_CHANGES), counters, l1, entry.get("storage", "fp32"),
                             entry.get("stored_as", ""))
            self._tables[serial] = view
        return view

    def volatile(self, table_id: str) -> TableReader | None:
        """A lock-free reader of a hash-map table, or None when the tier holds no such table."""
        held = self._volatile.get(table_id)
        if held is not None:
            return held[1]
        entry = self.manifest["volatile"]["tables"].get(table_id)
        if entry is None:
            return None
        prefix, region = entry["prefix"], self.region
        # a worker writes its reads' stamps (the clock, the readers' halves of meta); a read-only reader writes none
        mapped = {part: open_spec(region, spec, writable=self.writable and part in entry["writable"])
                  for part, spec in entry["arrays"].items()}
        ctrl, meta, rows = mapped[hashmap.CTRL], mapped[hashmap.META], mapped[hashmap.ROWS]
        stamps = stamp_halves(meta)[1] if self.writable else None

        def open_index(gen: int) -> np.ndarray:
            name = hashmap.index_name(prefix, gen)
            size = (region.path / name).stat().st_size // 4
            return region.open(name, (size,), np.int32, writable=False)

        gen = int(ctrl[hk.CTRL_INDEX_GEN])
        arrays = TableArrays(ctrl=ctrl, meta=meta, rows=rows, reader_stamps=stamps, index=open_index(gen),
                             index_gen=gen)
        reader = TableReader(arrays, open_index, lfu=bool(self.manifest["volatile"]["lfu"]))
        self._volatile[table_id] = (prefix, reader)
        return reader

    def queue(self, worker: int) -> Ring:
        spec = self.manifest["queues"][worker]
        return Ring(open_spec(self.region, spec["ctrl"]), open_spec(self.region, spec["data"]))

    def requests(self) -> np.ndarray:
        return open_spec(self.region, self.manifest["requests"])

    def read_json(self, name: str, default: Any = None) -> Any:
        """A small JSON file the owner keeps in this generation, or ``default`` when it has none yet."""
        try:
            return json.loads((self.path / name).read_text())
        except (FileNotFoundError, ValueError):
            return default

    def workers(self) -> np.ndarray:
        return open_spec(self.region, self.manifest["workers"])
