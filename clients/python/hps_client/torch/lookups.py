"""The lookups behind the custom ops, as tensors: one table's rows per id, one table's pooled bags, and a
collection's features (KeyedJaggedTensor layout: every key's bags one after another, ``stride`` bags a key) looked
up in one request. Each lands its rows on the device asked (:func:`hps_client.torch.staging.rows_on`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hps_client.bags import Bags
from hps_client.errors import InvalidArgumentError
from hps_client.torch.inputs import bags_of, keys_of
from hps_client.torch.sources import Source
from hps_client.torch.staging import rows_on


@dataclass(frozen=True)
class TableSpec:
    """A collection's table: its served name, pooling (``"sum"`` or ``"mean"``) and dim."""

    name: str
    mode: str
    dim: int


def embedding_rows(src: Source, table: str, ids: torch.Tensor, dim: int, device: torch.device) -> torch.Tensor:
    """The ``(*ids.shape, dim)`` rows of ``ids``."""
    keys = keys_of(ids)

    def fill(out: np.ndarray) -> None:
        src.client.lookup(src.model, table, keys, out=out, version=src.version, label=src.label)

    return rows_on(device, (*ids.shape, dim), fill, src.staging)


def bag_rows(src: Source, table: str, input: torch.Tensor, offsets: torch.Tensor | None,
             weights: torch.Tensor | None, mode: str, include_last_offset: bool, dim: int,
             device: torch.device) -> torch.Tensor:
    """One pooled row per bag, ``(bags, dim)``, as ``torch.nn.functional.embedding_bag`` answers."""
    keys, starts, w = bags_of(input, offsets, weights, mode, include_last_offset)

    def fill(out: np.ndarray) -> None:
        if keys.shape[0] == 0:  # every bag empty
            out.fill(0)
            return
        src.client.lookup_bags(src.model, table, keys, starts, mode, w, out=out, version=src.version,
                               label=src.label)

    return rows_on(device, (starts.shape[0], dim), fill, src.staging)


def _feature_spans(offsets: np.ndarray, stride: int, position: int) -> tuple[int, int, np.ndarray]:
    """The ``(first, last)`` value index of the key at ``position`` and its bags' starts relative to ``first``."""
    bounds = offsets[position * stride:(position + 1) * stride + 1]
    if bounds.shape[0] != stride + 1:
        raise InvalidArgumentError(f"the KeyedJaggedTensor's offsets ({offsets.shape[0]}) do not hold {stride} bags "
                                   f"of key {position}")
    return int(bounds[0]), int(bounds[-1]), bounds[:-1] - bounds[0]


def pooled_features(src: Source, tables: Sequence[TableSpec], values: torch.Tensor, offsets: torch.Tensor,
                    weights: torch.Tensor | None, stride: int, features: Sequence[int], feature_tables: Sequence[int],
                    device: torch.device) -> torch.Tensor:
    """``(stride, sum of dims)``: for each output feature (its key's position in ``features``, its table's index in
    ``feature_tables``), its pooled rows side by side, every table's bags in one request."""
    keys = keys_of(values)
    offs = np.ascontiguousarray(offsets.detach().to("cpu", torch.int64).numpy())
    w = None if weights is None else weights.detach().reshape(-1).to("cpu", torch.float32).numpy()
    if offs.shape[0] == 0 or offs[-1] > keys.shape[0]:
        raise InvalidArgumentError(f"the KeyedJaggedTensor's offsets end past its {keys.shape[0]} values")
    by_table: dict[int, list[tuple[int, int, int, np.ndarray]]] = {}
    for j, (position, t) in enumerate(zip(features, feature_tables)):
        first, last, starts = _feature_spans(offs, stride, position)
        by_table.setdefault(t, []).append((j, first, last, starts))
    requests: dict[str, Bags] = {}
    for t, spans in by_table.items():
        if all(last == first for _, first, last, _ in spans):
            continue  # every bag of the table empty: zeros, asked of no one
        shifts = np.cumsum([0] + [last - first for _, first, last, _ in spans[:-1]])
        requests[tables[t].name] = Bags(
            np.concatenate([keys[first:last] for _, first, last, _ in spans]),
            np.concatenate([starts + shift for (_, _, _, starts), shift in zip(spans, shifts)]),
            tables[t].mode,
            None if w is None else np.concatenate([w[first:last] for _, first, last, _ in spans]))
    columns = np.cumsum([0] + [tables[t].dim for t in feature_tables])

    def fill(out: np.ndarray) -> None:
        answers = (src.client.lookup_bags_many(src.model, requests, version=src.version, label=src.label)
                   if requests else {})
        for t, spans in by_table.items():
            spec = tables[t]
            rows = answers[spec.name].vectors if spec.name in answers else None
            for k, (j, _, _, _) in enumerate(spans):
                part = out[:, columns[j]:columns[j + 1]]
                if rows is None:
                    part.fill(0)
                else:
                    part[...] = rows[k * stride:(k + 1) * stride]

    return rows_on(device, (stride, int(columns[-1])), fill, src.staging)


def unpooled_features(src: Source, tables: Sequence[TableSpec], values: torch.Tensor, offsets: torch.Tensor,
                      stride: int, features: Sequence[int], feature_tables: Sequence[int], dim: int,
                      device: torch.device) -> torch.Tensor:
    """``(values, dim)``: the row of every value of the output features' keys (zeros for keys none reads), each
    table's keys in one request."""
    keys = keys_of(values)
    offs = np.ascontiguousarray(offsets.detach().to("cpu", torch.int64).numpy())
    by_table: dict[str, list[tuple[int, int]]] = {}
    for position, t in zip(features, feature_tables):
        first, last, _ = _feature_spans(offs, stride, position)
        if last > first:
            by_table.setdefault(tables[t].name, []).append((first, last))
    requests = {name: np.concatenate([keys[a:b] for a, b in spans]) for name, spans in by_table.items()}

    def fill(out: np.ndarray) -> None:
        out.fill(0)
        if not requests:
            return
        answers = src.client.lookup_many(src.model, requests, version=src.version, label=src.label)
        for name, spans in by_table.items():
            rows, at = answers[name].vectors, 0
            for a, b in spans:
                out[a:b] = rows[at:at + b - a]
                at += b - a

    return rows_on(device, (keys.shape[0], dim), fill, src.staging)
