"""Colocated reads: an inference process in the server's pod reads the node's shared store directly.

    client = LocalClient("/dev/shm/hps")            # or HPSClient("local:///dev/shm/hps")
    rows = client.lookup("demo", "item", keys)      # L1 and hash-map hits at memory speed, the rest over the socket

The server (``server.local.enabled``) keeps its store at ``server.local.path``, readable by its user and group
(mode 0640). A LocalClient maps it read-only and answers the keys L1 and the in-process hash map hold in the
calling thread, under the same sequence locks as the server's workers (a read that overlapped a write is read
again, so a row is never torn); the keys neither holds go to the server over gRPC on its Unix domain socket (the
server reads RocksDB, answers defaults and admits the rows as for any lookup). Updates the server applied are in
the store when it acknowledges them: the next read sees them. When the server restarts (a new store generation) or
dies, the client drops its mapping and sends whole lookups over the socket (waiting for the server to answer,
within ``timeout``) until the new store is there, then maps it. Reads by a LocalClient are not counted in the
server's statistics or in L1's LRU/LFU order (its mapping is read-only).

The socket is the one the mapped store names (the server's ``server.uds_path``, by default
``<local.path>/grpc.sock``); ``socket_path=`` overrides it. A socket that is not there, and never was since the
client started, is an UnavailableError naming it at once (not a wait for the whole timeout).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from hps_client.buffers import check_out
from hps_client.channel import Metadata, channel_options, merge_metadata
from hps_client.errors import InvalidArgumentError, UnavailableError
from hps_client.rows import StoredAnswer, StoredRows
from hps_client.stub import EmbeddingStub
from hps_client.wire import (
    TableAnswer,
    as_error,
    as_keys,
    build_request,
    decode_answer,
    decode_stored,
    into,
)
from hps_service.engine.read import Reader
from hps_service.engine.table import ServedTable
from hps_service.engine.ttl import manifest_ttl
from hps_service.engine.versions import resolve
from hps_service.errors import HPSError
from hps_service.keys import unique_with_inverse
from hps_service.node.reader_tiers import SharedVolatile
from hps_service.node.shared_l1 import SharedL1Reader
from hps_service.node.store import layout
from hps_service.node.store.node_store import T_L1_GEN
from hps_service.node.store.view import StoreView
from hps_service.node.worker_engine import PublishedGeneration
from hps_service.proto.hps.v1 import embedding_pb2 as pb

_INT64 = np.dtype(np.int64)
#: How often the store's owner is checked to be alive (its lock), and a missing store looked for again.
LIVENESS_PERIOD_S = 0.01
ATTACH_PERIOD_S = 0.05
#: Batch sizes whose hit mask a thread keeps for the next call of that size (more sizes: the masks start again).
SCRATCH_SIZES = 8
#: The socket a server with ``server.local`` enabled listens on, inside the store's directory.
SOCKET_NAME = "grpc.sock"


class _Table:
    """One table as this client reads it from the mapped store: its L1 and hash map, read by the engine's reader."""

    def __init__(self, view: StoreView, serial: int, version: int = 0) -> None:
        """``version``: the model version the table is of (its misses ask the server for that version)."""
        self.version = version
        tv = view.table(serial)
        entry = view.manifest["tables"][str(serial)].get("l1")
        l1 = (SharedL1Reader(tv.l1, entry, PublishedGeneration(tv.control, T_L1_GEN).read, None, touch=False)
              if tv.l1 is not None and entry is not None else None)
        self.served = ServedTable(model=tv.model, name=tv.table, dim=tv.dim, default=tv.default, cache=l1,
                                  storage=tv.storage, stored_as=tv.stored_as,
                                  ttl_s=manifest_ttl(view.manifest, tv.model, tv.table))
        volatile = SharedVolatile(lambda: view) if view.volatile(self.served.id) is not None else None
        self.reader = Reader(volatile, None, max_batch_keys=0)
        # L1 read straight into the answer by LocalClient.lookup (None: its reads need the reader's expiry check
        # or decode)
        self.l1_fp32 = l1 if self.served.ttl_s is None and self.served.format.identity else None


class LocalClient:
    """The methods of :class:`hps_client.HPSClient` (``lookup``, ``lookup_with_sources``, ``lookup_many``,
    ``lookup_stored``, ``list_models``, ``close``), answered from the server's shared store where it can (see the
    module docstring)."""

    def __init__(self, path: str | Path = "/dev/shm/hps", timeout: float | None = 5.0, *,
                 socket_path: str | Path | None = None, retries: int = 3, backoff_s: float = 0.05,
                 metadata: Metadata | None = None, interceptors: Sequence[Any] | None = None) -> None:
        """``path``: the server's ``server.local.path``; ``socket_path``: its socket, when the store (which names
        it) cannot be mapped; ``timeout`` bounds each call that needs the server (misses, or all of it while no
        store is mapped); ``metadata`` and ``interceptors`` as in HPSClient, for the calls over the socket."""
        self.path = Path(path)
        self.timeout = timeout
        self._fixed_socket = socket_path is not None
        self.socket_path = Path(socket_path) if socket_path is not None else self.path / SOCKET_NAME
        self.metadata = merge_metadata(metadata, None)
        self._channel_options = channel_options(retries, backoff_s)
        self._interceptors = tuple(interceptors or ())
        self._socket_seen = False
        self._channel, self._stub = self._open(self.socket_path)
        self._lock = threading.Lock()
        self._scratch = threading.local()
        self._view: StoreView | None = None
        self._tables: dict[tuple[str, str, int | None, str], _Table] = {}
        self._checked_at = 0.0
        self._attach_at = 0.0
        self.remaps = 0  # times a new generation of the store was mapped (the server restarted)
        self._generation: int | None = None
        self._attach(first=True)

    def _open(self, socket_path: Path) -> tuple[grpc.Channel, EmbeddingStub]:
        channel = grpc.insecure_channel(f"unix:{socket_path}", options=self._channel_options)
        if self._interceptors:
            channel = grpc.intercept_channel(channel, *self._interceptors)
        return channel, EmbeddingStub(channel)

    def _follow_socket(self, view: StoreView) -> None:
        """Call the server on the socket the store names (when the caller gave none). A serving store's socket is
        known to be there: missing later, it is the server restarting."""
        named = view.manifest.get("socket")
        if not self._fixed_socket and named and Path(named) != self.socket_path:
            old = self._channel
            self.socket_path = Path(named)
            self._channel, self._stub = self._open(self.socket_path)
            old.close()
        self._socket_seen = self._socket_seen or bool(named) or self.socket_path.is_socket()

    def _server_stub(self) -> EmbeddingStub:
        """The stub over the server's socket; UnavailableError naming the socket at once when it is not there and
        never was (a wrong path, or no server): later, a missing socket is a server restarting, waited for."""
        if not self._socket_seen:
            if not self.socket_path.is_socket():
                raise UnavailableError(
                    f"no server socket at {self.socket_path}: is the server running with server.local enabled and "
                    f"server.uds_path there (or pass socket_path=)?")
            self._socket_seen = True
        return self._stub

    # ---- the store ----------------------------------------------------------------------------
    def _attach(self, first: bool = False) -> None:
        """Map the live generation of the store, if there is one (else read over the socket for now). A store this
        process may not map is an error the first time (the pod's user or group is wrong), not a reason to wait."""
        self._attach_at = time.monotonic()
        try:
            view = StoreView.attach(self.path, writable=False)
        except PermissionError:
            if first:
                raise
            return
        except (UnavailableError, HPSError, FileNotFoundError, KeyError, ValueError):
            return
        if view.state() != layout.SERVING:
            return
        with self._lock:
            if self._view is None or self._view.generation != view.generation:
                self.remaps += self._generation is not None and self._generation != view.generation
                self._generation = view.generation
                self._view, self._tables = view, {}
                self._follow_socket(view)

    def _drop(self) -> None:
        with self._lock:
            self._view, self._tables = None, {}

    def _current(self) -> StoreView | None:
        """The mapped store if it is still the live one: not closed, its owner alive (checked every
        ``LIVENESS_PERIOD_S``), its manifest followed. Else None, after looking for a new one now and then."""
        view = self._view
        now = time.monotonic()
        if view is not None:
            words = view.header_words
            if words[layout.H_STATE] != layout.SERVING:
                self._drop()
                view = None
            elif now - self._checked_at > LIVENESS_PERIOD_S:
                self._checked_at = now
                if not layout.owner_alive(view.path / layout.LOCK):
                    self._drop()
                    view = None
        if view is None:
            if now - self._attach_at > ATTACH_PERIOD_S:
                self._attach()
            return self._view
        if words[layout.H_MANIFEST] != view.manifest_gen:  # view.changed(), inline: this runs on every call
            with self._lock:
                try:
                    view.reload()
                except UnavailableError:
                    self._view, self._tables = None, {}
                    return None
                self._tables = {}
        return view

    def _table(self, view: StoreView, model: str, table: str, version: int | None = None,
               label: str = "") -> _Table | None:
        """The table of the model version that ``version`` or ``label`` names in the mapped manifest, resolved as the
        server resolves it (neither: the version the label ``production`` names, else the model as configured); None
        where the manifest does not tell (both named, a label or version it lacks): the server answers or refuses
        that lookup. A new manifest (a label switch) drops these."""
        t = self._tables.get((model, table, version, label))
        if t is None:
            try:
                name, resolved = resolve(view.manifest.get("labels", {}), view.manifest["served"], model, version,
                                         label)
            except HPSError:
                return None
            serial = view.served(name, table)
            if serial is None:
                return None  # the server answers NOT_FOUND (or knows it by now)
            t = _Table(view, serial, resolved)
            self._tables[(model, table, version, label)] = t
        return t

    # ---- lookups ------------------------------------------------------------------------------
    def lookup(self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None, *,
               metadata: Metadata | None = None, out: np.ndarray | None = None, version: int | None = None,
               label: str = "") -> np.ndarray:
        """Rows of ``keys`` as an (n, dim) float32 array, in the order asked; written into ``out`` when given (a
        writable C-contiguous float32 ``(n, dim)`` array the caller reuses: L1 hits are copied there directly). From
        the model's ``version``, or the one ``label`` names (neither: its label ``production``), as HPSClient."""
        view = self._current()
        t = self._tables.get((model, table, version, label)) if view is not None else None
        if (t is not None and t.l1_fp32 is not None and type(keys) is np.ndarray and keys.dtype is _INT64
                and keys.ndim == 1 and keys.flags.c_contiguous and keys.shape[0]):
            # The usual call, kept to one compiled read when every key hits L1: a few microseconds of Python here
            # were as much as the read of 256 rows itself
            l1 = t.l1_fp32
            n = keys.shape[0]
            out = np.empty((n, l1.dim), dtype=np.float32) if out is None else check_out(out, n, l1.dim)
            try:
                hit = self._scratch.hits[n]
            except (AttributeError, KeyError):
                hit = self._hit_mask(n)
            nhit = l1.read_once(keys, out, hit)
            if nhit == n or (nhit < 0 and l1.read(keys, out, hit) == n):
                return out
            answer, miss = self._read_local(t, keys, out, hit)
            if miss is not None:
                self._fetch_misses(model, table, t, keys, answer, miss, timeout, metadata)
            return answer.vectors
        return self.lookup_with_sources(model, table, keys, timeout, metadata=metadata, out=out, version=version,
                                        label=label).vectors

    def _hit_mask(self, n: int) -> np.ndarray:
        """This thread's hit mask for batches of ``n`` keys (a few sizes kept): a lookup's L1 read fills it, and
        nothing keeps it past the lookup."""
        hits: dict[int, np.ndarray] = getattr(self._scratch, "hits", None) or {}
        if len(hits) >= SCRATCH_SIZES:
            hits.clear()
        hits[n] = np.empty(n, dtype=np.bool_)
        self._scratch.hits = hits
        return hits[n]

    def lookup_with_sources(self, model: str, table: str, keys: np.ndarray | Sequence[int],
                            timeout: float | None = None, *, metadata: Metadata | None = None,
                            out: np.ndarray | None = None, version: int | None = None,
                            label: str = "") -> TableAnswer:
        """Rows of ``keys`` and, per key, which level answered (1 cache, 2 volatile, 3 persistent, 4 default,
        5 expired); the rows written into ``out`` when given, as :meth:`lookup`."""
        view = self._current()
        t = self._tables.get((model, table, version, label)) if view is not None else None
        if t is None or not model:  # not mapped yet (or a bad request): the general path says why
            return into(out, self.lookup_many(model, {table: keys}, timeout, metadata=metadata, version=version,
                                              label=label)[table])
        keys = as_keys(keys)  # the usual call: one table already mapped
        if keys.shape[0] == 0:
            return into(out, self.lookup_many(model, {table: keys}, timeout, metadata=metadata, version=version,
                                              label=label)[table])
        answer, miss = self._read_local(t, keys, out)
        if miss is not None:
            self._fetch_misses(model, table, t, keys, answer, miss, timeout, metadata)
        return answer

    def _fetch_misses(self, model: str, table: str, t: _Table, keys: np.ndarray, answer: TableAnswer,
                      miss: np.ndarray, timeout: float | None, metadata: Metadata | None) -> None:
        """The rows of ``keys[miss]`` from the server into ``answer``, from the version the hits came from (whatever
        the label names now)."""
        uniq, inverse = unique_with_inverse(keys[miss])
        got = self._call(build_request(model, {table: uniq}, version=t.version), timeout, metadata)[table]
        answer.vectors[miss] = got.vectors[inverse]
        answer.sources[miss] = got.sources[inverse]

    def lookup_stored(self, model: str, table: str, keys: np.ndarray | Sequence[int],
                      timeout: float | None = None, *, metadata: Metadata | None = None, version: int | None = None,
                      label: str = "") -> StoredAnswer:
        """Rows of ``keys`` as the table stores them (as :meth:`hps_client.HPSClient.lookup_stored`): L1 and
        hash-map hits copied as they are, with no decoding, the rest from the server."""
        view = self._current()
        t = self._table(view, model, table, version, label) if view is not None and model else None
        keys = as_keys(keys)
        if t is None or not model or keys.shape[0] == 0:
            request = build_request(model, {table: keys}, pb.PRECISION_STORED, version, label)
            answer: StoredAnswer = self._call(request, timeout, metadata, decode_stored)[table]
            return answer
        fmt = t.served.format
        words = np.empty((keys.shape[0], fmt.words), dtype=np.float32)
        sources = np.empty(keys.shape[0], dtype=np.uint8)
        miss = t.reader.lookup_held(t.served, keys, words, sources, stored=True)
        if miss.shape[0]:
            uniq, inverse = unique_with_inverse(keys[miss])
            got = self._call(build_request(model, {table: uniq}, pb.PRECISION_STORED, t.version), timeout, metadata,
                             decode_stored)[table]
            words[miss] = got.rows.words.view(np.float32)[inverse]
            sources[miss] = got.sources[inverse]
        return StoredAnswer(StoredRows(fmt.storage, fmt.dim, words.view(np.uint32)), sources)

    def lookup_many(self, model: str, tables: Mapping[str, np.ndarray | Sequence[int]],
                    timeout: float | None = None, *, metadata: Metadata | None = None, version: int | None = None,
                    label: str = "") -> dict[str, TableAnswer]:
        """Several tables of one model (of ``version``, or the one ``label`` names, as :meth:`lookup`): each table's
        hits read here, all their misses in one call to the server."""
        if not model:
            raise InvalidArgumentError("model name is empty")
        if not tables:
            raise InvalidArgumentError("the request names no table")
        view = self._current()
        answers: dict[str, TableAnswer] = {}
        missing: dict[str, np.ndarray] = {}
        positions: dict[str, tuple[np.ndarray, np.ndarray] | None] = {}
        versions = set()
        for name, raw in tables.items():
            keys = as_keys(raw)
            t = self._table(view, model, name, version, label) if view is not None else None
            if t is None or keys.shape[0] == 0:
                missing[name], positions[name] = keys, None
                continue
            versions.add(t.version)
            answer, miss = self._read_local(t, keys)
            answers[name] = answer
            if miss is not None:
                uniq, inverse = unique_with_inverse(keys[miss])
                missing[name], positions[name] = uniq, (miss, inverse)
        if missing:  # every table of one request from one version: the one its local reads came from
            request = (build_request(model, missing, version=versions.pop()) if versions
                       else build_request(model, missing, version=version, label=label))
            fetched = self._call(request, timeout, metadata)
            for name, where in positions.items():
                got = fetched[name]
                if where is None:
                    answers[name] = got
                else:
                    miss, inverse = where
                    answers[name].vectors[miss] = got.vectors[inverse]
                    answers[name].sources[miss] = got.sources[inverse]
        return {name: answers[name] for name in tables}

    @staticmethod
    def _read_local(t: _Table, keys: np.ndarray, out: np.ndarray | None = None,
                    hit: np.ndarray | None = None) -> tuple[TableAnswer, np.ndarray | None]:
        """L1, then the hash map for what L1 missed, into ``out`` (or a new array); returns the answer and the
        indices still missing (or None). ``hit``: L1 was already read into ``out``, with this mask."""
        n = keys.shape[0]
        out = np.empty((n, t.served.dim), dtype=np.float32) if out is None else check_out(out, n, t.served.dim)
        sources = np.empty(n, dtype=np.uint8)
        miss = t.reader.lookup_held(t.served, keys, out, sources, hit=hit)
        return TableAnswer(out, sources), (miss if miss.shape[0] else None)

    def _call(self, request: pb.LookupRequest, timeout: float | None, metadata: Metadata | None,
              decode: Callable[[Any], Any] = decode_answer) -> dict[str, Any]:
        """The server's answer over the Unix domain socket, waiting (within the timeout) while it is not there or
        not serving yet: the one server of a pod restarting (compiling, loading) is a wait, not an error."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        metadata = merge_metadata(self.metadata, metadata)
        stub = self._server_stub()
        backoff = 0.05
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            try:
                response = stub.Lookup(request, timeout=left, wait_for_ready=True, metadata=metadata)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE and (
                        deadline is None or time.monotonic() + backoff < deadline):
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 0.5)
                    continue
                raise as_error(err) from None
            return {tv.table: decode(tv) for tv in response.tables}

    def list_models(self, timeout: float | None = None, *,
                    metadata: Metadata | None = None) -> dict[str, dict[str, int]]:
        """``{model: {table: dim}}`` of the models the server serves."""
        view = self._current()
        if view is not None:
            return {m["name"]: {t["name"]: int(t["dim"]) for t in m["tables"]} for m in view.manifest["models"]}
        try:
            response = self._server_stub().ListModels(
                pb.ListModelsRequest(), timeout=self.timeout if timeout is None else timeout, wait_for_ready=True,
                metadata=merge_metadata(self.metadata, metadata))
        except grpc.RpcError as err:
            raise as_error(err) from None
        return {m.name: {t.name: t.dim for t in m.tables} for m in response.models}

    @property
    def mapped(self) -> bool:
        """Whether a live store is mapped now (else every lookup goes over the socket)."""
        return self._current() is not None

    def close(self) -> None:
        self._drop()
        self._channel.close()

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
