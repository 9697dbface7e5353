"""The colocated transport: an inference process in the server's pod reads the node's shared store directly.

    client = HPSClient("local:///dev/shm/hps")      # or hps_service.local.LocalClient("/dev/shm/hps")
    rows = client.lookup("demo", "item", keys)      # L1 and hash-map hits at memory speed, the rest over the socket

The server (``server.local.enabled``) keeps its store at ``server.local.path``, readable by its user and group
(mode 0640). This transport maps it read-only and answers the keys L1 and the in-process hash map hold in the
calling thread, under the same sequence locks as the server's workers (a read that overlapped a write is read
again, so a row is never torn); the keys neither holds go to the server over gRPC on its Unix domain socket (the
server reads RocksDB, answers defaults and admits the rows as for any lookup). Updates the server applied are in
the store when it acknowledges them: the next read sees them. When the server restarts (a new store generation) or
dies, the transport drops its mapping and sends whole lookups over the socket (waiting for the server to answer,
within the call's deadline) until the new store is there, then maps it. Its reads are not counted in the server's
statistics or in L1's LRU/LFU order (its mapping is read-only).

The socket is the one the mapped store names (the server's ``server.uds_path``, by default
``<local.path>/grpc.sock``); ``socket_path=`` overrides it. A socket that is not there, and never was since the
transport started, is an UnavailableError naming it at once (not a wait for the whole deadline).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
import numpy as np

from hps_client.bags import Pooling
from hps_client.buffers import check_out
from hps_client.calls import Call, ClusterInfo, ListModels, Lookup, Ready, Rows, Stream
from hps_client.channel import channel_options
from hps_client.errors import UnavailableError
from hps_client.routing import CLUSTER_INFO, remaining
from hps_client.rows import StoredAnswer, StoredRows
from hps_client.streams import stream_answers
from hps_client.stub import EmbeddingStub
from hps_client.wire import TableAnswer, as_error, build_request, decode_answer, decode_stored
from hps_service.engine.bags import BagReader, check_bags
from hps_service.engine.levels import LookupResult
from hps_service.engine.read import Reader
from hps_service.engine.versions import resolve
from hps_service.errors import HPSError
from hps_service.jit.views import read_only_view
from hps_service.keys import unique_with_inverse
from hps_service.node.reader_tiers import SharedVolatile
from hps_service.node.shared_tables import table_over_store
from hps_service.node.store import layout
from hps_service.node.store.view import StoreView
from hps_service.proto.hps.v1 import embedding_pb2 as pb

R = TypeVar("R")
#: How often the store's owner is checked to be alive (its lock), and a missing store looked for again.
LIVENESS_PERIOD_S = 0.01
ATTACH_PERIOD_S = 0.05
#: Batch sizes whose hit mask a thread keeps for the next call of that size (more sizes: the masks start again).
SCRATCH_SIZES = 8
#: The socket a server with ``server.local`` enabled listens on, inside the store's directory.
SOCKET_NAME = "grpc.sock"
#: Bags one pooled call may ask of the store (the server's own bound, server.max_batch_keys, applies to its part).
_MAX_BAGS = 1 << 24


class _Table:
    """One table as this transport reads it from the mapped store: its L1 and hash map, read by the engine's
    reader."""

    def __init__(self, view: StoreView, serial: int, version: int = 0) -> None:
        """``version``: the model version the table is of (its misses ask the server for that version)."""
        self.version = version
        self.served = table_over_store(view, serial, touch=False)
        volatile = SharedVolatile(lambda: view) if view.volatile(self.served.id) is not None else None
        self.reader = Reader(volatile, None, max_batch_keys=0)
        # L1 read straight into the answer by a Rows call (None: its reads need the reader's expiry check or decode)
        l1 = self.served.shared_l1
        plain = self.served.ttl_s is None and self.served.format.identity
        self.l1_fp32 = l1 if plain else None
        #: Without L1, the hash map's compiled pass, read straight into the answer by a Rows call (as L1 is).
        self.lane = volatile.lane(self.served.id) if plain and l1 is None and volatile is not None else None


def _one(call: Lookup, table: str) -> pb.LookupRequest:
    """The request of one table of ``call`` (with its bags when pooled)."""
    pooling = call.pooling or {}
    return Lookup(call.deadline, call.metadata, call.model, {table: call.tables[table]}, call.version, call.label,
                  pooling={table: pooling[table]} if table in pooling else None).request()


class ColocatedTransport:
    """Calls answered from the server's shared store where it can, over its socket otherwise (see the module
    docstring)."""

    def __init__(self, path: str | Path = "/dev/shm/hps", *, socket_path: str | Path | None = None,
                 retries: int = 3, backoff_s: float = 0.05, interceptors: Sequence[Any] = ()) -> None:
        """``path``: the server's ``server.local.path``; ``socket_path``: its socket, when the store (which names
        it) cannot be mapped; ``interceptors`` wrap the channel to the socket."""
        self.path = Path(path)
        self._fixed_socket = socket_path is not None
        self.socket_path = Path(socket_path) if socket_path is not None else self.path / SOCKET_NAME
        self._channel_options = channel_options(retries, backoff_s)
        self._interceptors = tuple(interceptors)
        self._socket_seen = False
        self._channel, self._stub = self._open(self.socket_path)
        self._lock = threading.Lock()
        self._scratch = threading.local()
        self._bags = BagReader()
        self._view: StoreView | None = None
        self._tables: dict[tuple[str, str, int | None, str], _Table] = {}
        self._checked_at = 0.0
        self._attach_at = 0.0
        self.remaps = 0  # times a new generation of the store was mapped (the server restarted)
        self._generation: int | None = None
        self._attach(first=True)

    def handle(self, call: Call[R]) -> R:
        """The answer of ``call`` (the transport's one method)."""
        answer: Any
        match call:
            case Rows():
                answer = self._rows(call)
            case Lookup():
                answer = self._stored(call) if call.stored else self._lookup(call)
            case ListModels():
                answer = self._list_models(call)
            case ClusterInfo():
                answer = self._server("GetClusterInfo", CLUSTER_INFO, call)
            case Ready():
                if not self.mapped:
                    self._server("GetClusterInfo", CLUSTER_INFO, call)
                answer = None
            case Stream():  # the owner answers a stream over the socket (a request at a time: no rows to map)
                answer = stream_answers(self._server_stub().StreamLookup, call.requests, call.max_in_flight,
                                        call.deadline, metadata=call.metadata)
            case _:
                raise TypeError(f"{type(call).__name__} is not a call this transport answers")
        return cast(R, answer)

    # ---- the socket -----------------------------------------------------------------------------
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

    def _server(self, method: str, request: Any, call: Call[Any], decode: Callable[[Any], Any] | None = None) -> Any:
        """The server's answer over the Unix domain socket, waiting (within the call's deadline) while it is not
        there or not serving yet: the one server of a pod restarting (compiling, loading) is a wait, not an error.
        ``decode``: a Lookup answer's tables decoded so (``{table: answer}``)."""
        stub = self._server_stub()
        backoff = 0.05
        while True:
            left = remaining(call.deadline)
            try:
                response = getattr(stub, method)(request, timeout=None if left is None else max(left, 0.001),
                                                 wait_for_ready=True, metadata=call.metadata)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE and (
                        call.deadline is None or time.monotonic() + backoff < call.deadline):
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 0.5)
                    continue
                raise as_error(err) from None
            return response if decode is None else {tv.table: decode(tv) for tv in response.tables}

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
            try:
                t = _Table(view, serial, resolved)
            except (FileNotFoundError, UnavailableError):  # freed after a newer manifest left it out: the server answers
                return None
            self._tables[(model, table, version, label)] = t
        return t

    # ---- lookups ------------------------------------------------------------------------------
    def _rows(self, call: Rows) -> np.ndarray:
        """A Rows call: with its table mapped and every key in L1, one compiled read into the answer (a few
        microseconds of Python here were as much as the read of 256 rows itself)."""
        view = self._current()
        t = self._tables.get((call.model, call.table, call.version, call.label)) if view is not None else None
        keys = call.keys
        n = keys.shape[0]
        if t is not None and t.l1_fp32 is not None and n:
            l1 = t.l1_fp32
            out = np.empty((n, l1.dim), dtype=np.float32) if call.out is None else check_out(call.out, n, l1.dim)
            try:
                hit = self._scratch.hits[n]
            except (AttributeError, KeyError):
                hit = self._hit_mask(n)
            nhit = l1.read_once(keys, out, hit)
            if nhit == n or (nhit < 0 and l1.read(keys, out, hit) == n):
                return out
            local, miss = self._read_local(t, keys, out, hit)
            if miss is not None:
                self._fetch_misses(call.model, call.table, t, keys, local, miss, call)
            return local.vectors
        if t is not None and t.lane is not None and n:
            out = np.empty((n, t.served.dim), dtype=np.float32) if call.out is None else check_out(call.out, n,
                                                                                                    t.served.dim)
            sources, miss_idx = self._lane_scratch(n)
            if t.lane(keys if not keys.flags.writeable else read_only_view(keys), out, sources, miss_idx)[0] == n:
                return out
            local, miss = self._read_local(t, keys, out)
            if miss is not None:
                self._fetch_misses(call.model, call.table, t, keys, local, miss, call)
            return local.vectors
        return self._lookup(call.as_lookup())[call.table].vectors

    def _lane_scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """This thread's sources and miss indices for the compiled pass over batches of ``n`` keys (a few sizes
        kept; nothing keeps them past the call)."""
        lanes: dict[int, tuple[np.ndarray, np.ndarray]] = getattr(self._scratch, "lanes", None) or {}
        got = lanes.get(n)
        if got is None:
            if len(lanes) >= SCRATCH_SIZES:
                lanes.clear()
            got = lanes[n] = (np.empty(n, dtype=np.uint8), np.empty(n, dtype=np.intp))
            self._scratch.lanes = lanes
        return got

    def _hit_mask(self, n: int) -> np.ndarray:
        """This thread's hit mask for batches of ``n`` keys (a few sizes kept): a lookup's L1 read fills it, and
        nothing keeps it past the lookup."""
        hits: dict[int, np.ndarray] = getattr(self._scratch, "hits", None) or {}
        if len(hits) >= SCRATCH_SIZES:
            hits.clear()
        hits[n] = np.empty(n, dtype=np.bool_)
        self._scratch.hits = hits
        return hits[n]

    def _fetch_misses(self, model: str, table: str, t: _Table, keys: np.ndarray, answer: TableAnswer,
                      miss: np.ndarray, call: Call[Any]) -> None:
        """The rows of ``keys[miss]`` from the server into ``answer``, from the version the hits came from (whatever
        the label names now)."""
        uniq, inverse = unique_with_inverse(keys[miss])
        got = self._server("Lookup", build_request(model, {table: uniq}, version=t.version), call,
                           decode_answer)[table]
        answer.vectors[miss] = got.vectors[inverse]
        answer.sources[miss] = got.sources[inverse]

    def _lookup(self, call: Lookup) -> dict[str, TableAnswer]:
        """Several tables of one model (of the version the call names, or its label's): each table's hits read here,
        all their misses in one call to the server, from the version the hits came from."""
        view = self._current()
        answers: dict[str, TableAnswer] = {}
        missing: dict[str, np.ndarray] = {}
        positions: dict[str, tuple[np.ndarray, np.ndarray] | None] = {}
        versions = set()
        out = call.out if len(call.tables) == 1 else None
        pooling = call.pooling or {}
        for name, keys in call.tables.items():
            t = self._table(view, call.model, name, call.version, call.label) if view is not None else None
            if name in pooling:
                if t is None:  # the server pools it (or says why it cannot)
                    answers[name] = self._server("Lookup", _one(call, name), call, decode_answer)[name]
                else:
                    answers[name] = self._pool(t, call, name, keys, pooling[name], out)
                    versions.add(t.version)
                continue
            if t is None or keys.shape[0] == 0:
                missing[name], positions[name] = keys, None
                continue
            versions.add(t.version)
            answer, miss = self._read_local(t, keys, out)
            answers[name] = answer
            if miss is not None:
                uniq, inverse = unique_with_inverse(keys[miss])
                missing[name], positions[name] = uniq, (miss, inverse)
        if missing:
            request = (build_request(call.model, missing, version=versions.pop()) if versions
                       else build_request(call.model, missing, version=call.version, label=call.label))
            fetched = self._server("Lookup", request, call, decode_answer)
            for name, where in positions.items():
                got = fetched[name]
                if where is None:
                    answers[name] = got
                else:
                    miss, inverse = where
                    answers[name].vectors[miss] = got.vectors[inverse]
                    answers[name].sources[miss] = got.sources[inverse]
        return {name: answers[name] for name in call.tables}

    def _pool(self, t: _Table, call: Lookup, table: str, keys: np.ndarray, pooling: Pooling,
              out: np.ndarray | None) -> TableAnswer:
        """A pooled table: its unique keys read here (misses from the server, from the version the hits came from),
        pooled by the engine's kernel, as the server pools them."""
        bags = check_bags(keys.shape[0], pooling.offsets, int(pooling.combiner), pooling.weights, _MAX_BAGS,
                          f"table '{table}'")

        def rows(unique: np.ndarray, into: np.ndarray, answered: np.ndarray) -> LookupResult:
            miss = t.reader.lookup_held(t.served, unique, into, answered)
            if miss.shape[0]:
                got = self._server("Lookup", build_request(call.model, {table: unique[miss]}, version=t.version), call,
                                   decode_answer)[table]
                into[miss] = got.vectors
                answered[miss] = got.sources
            return LookupResult(into, answered)

        rows_out = None if out is None else check_out(out, bags.count, t.served.dim)
        result = self._bags.pool(rows, keys, t.served.dim, bags, rows_out)
        return TableAnswer(result.vectors, result.sources)

    def _stored(self, call: Lookup) -> dict[str, StoredAnswer]:
        """Rows as the table stores them (``precision = stored``): L1 and hash-map hits copied as they are, with no
        decoding, the rest from the server."""
        (table, keys), = call.tables.items()
        view = self._current()
        t = self._table(view, call.model, table, call.version, call.label) if view is not None else None
        if t is None or keys.shape[0] == 0:
            stored: dict[str, StoredAnswer] = self._server("Lookup", call.request(), call, decode_stored)
            return stored
        fmt = t.served.format
        words = np.empty((keys.shape[0], fmt.words), dtype=np.float32)
        sources = np.empty(keys.shape[0], dtype=np.uint8)
        miss = t.reader.lookup_held(t.served, keys, words, sources, stored=True)
        if miss.shape[0]:
            uniq, inverse = unique_with_inverse(keys[miss])
            request = build_request(call.model, {table: uniq}, pb.PRECISION_STORED, t.version)
            got = self._server("Lookup", request, call, decode_stored)[table]
            words[miss] = got.rows.words.view(np.float32)[inverse]
            sources[miss] = got.sources[inverse]
        return {table: StoredAnswer(StoredRows(fmt.storage, fmt.dim, words.view(np.uint32)), sources)}

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

    def _list_models(self, call: ListModels) -> pb.ListModelsResponse:
        """The models of the mapped manifest, or the server's answer when none is mapped."""
        view = self._current()
        if view is None:
            response: pb.ListModelsResponse = self._server("ListModels", pb.ListModelsRequest(), call)
            return response
        return pb.ListModelsResponse(models=[
            pb.ModelInfo(name=m["name"], tables=[pb.TableInfo(name=t["name"], dim=int(t["dim"])) for t in m["tables"]])
            for m in view.manifest["models"] if not m.get("version")])

    @property
    def mapped(self) -> bool:
        """Whether a live store is mapped now (else every lookup goes over the socket)."""
        return self._current() is not None

    def close(self) -> None:
        self._drop()
        self._channel.close()
