"""The lookups as ``torch.library`` custom ops (``torch.ops.hps.*``), each with a fake implementation that gives
the output's shape, dtype and device without looking anything up: ``torch.compile(fullgraph=True)`` and
``torch.export`` carry them as single opaque nodes. Each names its client by the ``ref`` a module bound
(:mod:`hps_client.torch.sources`) and first takes the rows of a matching prefetch, if one is pending."""

from __future__ import annotations

import torch
from torch import Tensor

from hps_client.torch import lookups
from hps_client.torch.prefetch import Prefetch
from hps_client.torch.sources import source


@torch.library.custom_op("hps::embedding", mutates_args=())
def embedding(ref: str, table: str, ids: Tensor, dim: int, device: torch.device) -> Tensor:
    """The ``(*ids.shape, dim)`` float32 rows of ``ids`` on ``device``."""
    src = source(ref)
    key = ("embedding", table, dim, device)
    rows = src.prefetches.take(key, (ids,))
    return rows if rows is not None else lookups.embedding_rows(src, table, ids, dim, device)


@embedding.register_fake
def _embedding_fake(ref: str, table: str, ids: Tensor, dim: int, device: torch.device) -> Tensor:
    return ids.new_empty((*ids.shape, dim), dtype=torch.float32, device=device)


@torch.library.custom_op("hps::embedding_bag", mutates_args=())
def embedding_bag(ref: str, table: str, input: Tensor, offsets: Tensor | None, per_sample_weights: Tensor | None,
                  mode: str, include_last_offset: bool, bags: int, dim: int, device: torch.device) -> Tensor:
    """The ``(bags, dim)`` float32 pooled rows of ``EmbeddingBag`` inputs on ``device``."""
    src = source(ref)
    key = ("embedding_bag", table, mode, include_last_offset, dim, device)
    rows = src.prefetches.take(key, (input, offsets, per_sample_weights))
    if rows is None:
        rows = lookups.bag_rows(src, table, input, offsets, per_sample_weights, mode, include_last_offset, dim, device)
    return rows


@embedding_bag.register_fake
def _embedding_bag_fake(ref: str, table: str, input: Tensor, offsets: Tensor | None,
                        per_sample_weights: Tensor | None, mode: str, include_last_offset: bool, bags: int, dim: int,
                        device: torch.device) -> Tensor:
    return input.new_empty((bags, dim), dtype=torch.float32, device=device)


@torch.library.custom_op("hps::pooled_features", mutates_args=())
def pooled_features(ref: str, values: Tensor, offsets: Tensor, weights: Tensor | None, stride: int,
                    features: list[int], feature_tables: list[int], dims: list[int], device: torch.device) -> Tensor:
    """``(stride, sum(dims))``: the pooled rows of a KeyedJaggedTensor's features side by side, in one request."""
    src = source(ref)
    key = ("pooled_features", stride, tuple(features), tuple(feature_tables), device)
    rows = src.prefetches.take(key, (values, offsets, weights))
    if rows is None:
        rows = lookups.pooled_features(src, src.plan, values, offsets, weights, stride, features, feature_tables,
                                       device)
    return rows


@pooled_features.register_fake
def _pooled_features_fake(ref: str, values: Tensor, offsets: Tensor, weights: Tensor | None, stride: int,
                          features: list[int], feature_tables: list[int], dims: list[int],
                          device: torch.device) -> Tensor:
    return values.new_empty((stride, sum(dims)), dtype=torch.float32, device=device)


@torch.library.custom_op("hps::unpooled_features", mutates_args=())
def unpooled_features(ref: str, values: Tensor, offsets: Tensor, stride: int, features: list[int],
                      feature_tables: list[int], dim: int, device: torch.device) -> Tensor:
    """``(values, dim)``: the row of each value of a KeyedJaggedTensor's features, each table in one request."""
    src = source(ref)
    key = ("unpooled_features", stride, tuple(features), tuple(feature_tables), dim, device)
    rows = src.prefetches.take(key, (values, offsets))
    if rows is None:
        rows = lookups.unpooled_features(src, src.plan, values, offsets, stride, features, feature_tables, dim,
                                         device)
    return rows


@unpooled_features.register_fake
def _unpooled_features_fake(ref: str, values: Tensor, offsets: Tensor, stride: int, features: list[int],
                            feature_tables: list[int], dim: int, device: torch.device) -> Tensor:
    return values.new_empty((values.shape[0], dim), dtype=torch.float32, device=device)


def prefetch_embedding(ref: str, table: str, ids: Tensor, dim: int, device: torch.device) -> Prefetch:
    """Start what :func:`embedding` of these arguments looks up; that call then takes its rows."""
    src = source(ref)
    return src.prefetches.start(("embedding", table, dim, device), (ids,),
                                lambda i: lookups.embedding_rows(src, table, i, dim, device), device)


def prefetch_embedding_bag(ref: str, table: str, input: Tensor, offsets: Tensor | None,
                           per_sample_weights: Tensor | None, mode: str, include_last_offset: bool, dim: int,
                           device: torch.device) -> Prefetch:
    """Start what :func:`embedding_bag` of these arguments looks up; that call then takes its rows."""
    src = source(ref)
    return src.prefetches.start(
        ("embedding_bag", table, mode, include_last_offset, dim, device), (input, offsets, per_sample_weights),
        lambda i, o, w: lookups.bag_rows(src, table, i, o, w, mode, include_last_offset, dim, device), device)


def prefetch_pooled_features(ref: str, values: Tensor, offsets: Tensor, weights: Tensor | None, stride: int,
                             features: list[int], feature_tables: list[int], device: torch.device) -> Prefetch:
    """Start what :func:`pooled_features` of these arguments looks up; that call then takes its rows."""
    src = source(ref)
    return src.prefetches.start(
        ("pooled_features", stride, tuple(features), tuple(feature_tables), device), (values, offsets, weights),
        lambda v, o, w: lookups.pooled_features(src, src.plan, v, o, w, stride, features, feature_tables, device),
        device)


def prefetch_unpooled_features(ref: str, values: Tensor, offsets: Tensor, stride: int, features: list[int],
                               feature_tables: list[int], dim: int, device: torch.device) -> Prefetch:
    """Start what :func:`unpooled_features` of these arguments looks up; that call then takes its rows."""
    src = source(ref)
    return src.prefetches.start(
        ("unpooled_features", stride, tuple(features), tuple(feature_tables), dim, device), (values, offsets),
        lambda v, o: lookups.unpooled_features(src, src.plan, v, o, stride, features, feature_tables, dim,
                                               device), device)
