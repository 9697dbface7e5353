"""Which client answers a module's lookups. A module binds its client, model and tables to a name (its ``ref``); the
custom ops carry that name, so a compiled or exported graph finds the client by name in this process. The name
says where the rows come from (the client's targets, the model, its version or label, the tables): a module built
again over a client of the same targets, in another process, binds the same name."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from hps_client.errors import NotFoundError
from hps_client.torch.prefetch import Prefetches
from hps_client.torch.staging import HostStaging


@dataclass
class Source:
    """A client and what it reads from (``model``, at ``version`` or ``label``), with the staging buffers and the
    pending prefetches of the modules bound to it."""

    client: Any
    model: str
    version: int | None
    label: str
    #: A collection's tables, in the order its ops number them.
    plan: tuple[Any, ...] = ()
    staging: HostStaging = field(default_factory=HostStaging)
    prefetches: Prefetches = field(default_factory=Prefetches)


_BOUND: dict[str, Source] = {}
_LOCK = threading.Lock()


def target_of(client: Any) -> str:
    """The targets a client reads from, as one string (its identity when it names none)."""
    targets = getattr(client, "targets", None)
    if targets:
        return ",".join(str(t) for t in targets)
    return f"client-{id(client):x}"


def bind(client: Any, model: str, version: int | None, label: str, *what: str, plan: tuple[Any, ...] = ()) -> str:
    """The name of ``what`` (a table, or a collection's tables and their ``plan``) read through ``client``, bound
    to it; a later binding of the same name to another client of the same targets replaces the client."""
    ref = "|".join((target_of(client), model, "" if version is None else str(version), label, *what))
    with _LOCK:
        bound = _BOUND.get(ref)
        if bound is None or bound.client is not client:
            _BOUND[ref] = Source(client, model, version, label, plan)
    return ref


def source(ref: str) -> Source:
    """What ``ref`` is bound to; NotFoundError when no module in this process bound it."""
    found = _BOUND.get(ref)
    if found is None:
        raise NotFoundError(f"no served table is bound to {ref!r} in this process: build the HPS module (over a "
                            f"client of the same targets) before running a graph that looks its rows up")
    return found


def served_dims(client: Any, model: str) -> dict[str, int]:
    """``{table: dim}`` of ``model`` as the server serves it; NotFoundError naming the models served otherwise."""
    models: dict[str, dict[str, int]] = client.list_models()
    if model not in models:
        raise NotFoundError(f"model {model!r} is not served at {target_of(client)} (it serves "
                            f"{', '.join(sorted(models)) or 'none'})")
    return models[model]


def served_dim(client: Any, model: str, table: str) -> int:
    """The dim of ``model``'s ``table``; NotFoundError naming the model's tables when it lacks that one."""
    tables = served_dims(client, model)
    if table not in tables:
        raise NotFoundError(f"model {model!r} has no table {table!r} (its tables: {', '.join(sorted(tables))})")
    return tables[table]
