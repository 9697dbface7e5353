"""The inputs of the modules checked and put in the wire's form: ids as int64 keys, ``EmbeddingBag`` inputs (1-D
with offsets, 2-D without, ``include_last_offset``, ``per_sample_weights``) as keys, bag starts and weights. Shape
and dtype checks (:func:`check_ids`, :func:`check_bag_shapes`) see only what a traced graph knows; the checks of
values (:func:`bags_of`) run where the lookup does."""

from __future__ import annotations

import numpy as np
import torch

from hps_client.errors import InvalidArgumentError

MODES = ("sum", "mean")
_INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_ids(ids: torch.Tensor, what: str = "ids") -> None:
    """InvalidArgumentError unless ``ids`` is a tensor of integers."""
    if not isinstance(ids, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a tensor of integer ids, got {type(ids).__name__}")
    if ids.dtype not in _INTEGERS:
        raise InvalidArgumentError(f"{what} must be integer ids (int64 or int32), got a {ids.dtype} tensor")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise InvalidArgumentError(f"mode {mode!r} is not served: pooled lookups are 'sum' or 'mean'")


def check_bag_shapes(input: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None, mode: str,
                     include_last_offset: bool) -> int:
    """The number of bags ``EmbeddingBag`` would answer for these shapes; InvalidArgumentError where it would
    refuse them (torch's rules: a 2-D input takes no offsets, a 1-D one needs 1-D offsets, weights only with sum
    and of the input's shape)."""
    check_ids(input, "input")
    if weights is not None:
        if mode != "sum":
            raise InvalidArgumentError(f"per_sample_weights are only served with mode 'sum', not {mode!r}")
        if not weights.is_floating_point():
            raise InvalidArgumentError(f"per_sample_weights must be floating point, got {weights.dtype}")
        if weights.shape != input.shape:
            raise InvalidArgumentError(f"per_sample_weights has shape {tuple(weights.shape)} but input has "
                                       f"{tuple(input.shape)}: one weight per id")
    if input.dim() == 2:
        if offsets is not None:
            raise InvalidArgumentError("a 2-D input is a batch of fixed-length bags: offsets must be None")
        return int(input.shape[0])
    if input.dim() != 1:
        raise InvalidArgumentError(f"input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
    if offsets is None:
        raise InvalidArgumentError("a 1-D input needs offsets (each bag's start in input)")
    check_ids(offsets, "offsets")
    if offsets.dim() != 1:
        raise InvalidArgumentError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
    if include_last_offset:
        if offsets.shape[0] < 1:
            raise InvalidArgumentError("with include_last_offset, offsets needs at least its last entry")
        return int(offsets.shape[0]) - 1
    return int(offsets.shape[0])


def keys_of(ids: torch.Tensor) -> np.ndarray:
    """``ids`` flattened into contiguous int64 keys on the host."""
    return np.ascontiguousarray(ids.detach().reshape(-1).to("cpu", torch.int64).numpy())


def bags_of(input: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None, mode: str,
            include_last_offset: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(keys, starts, weights)`` of ``EmbeddingBag`` inputs, each bag from its start to the next one's (the last
    to the end of the keys); InvalidArgumentError for offsets that disagree with the input."""
    check_mode(mode)
    check_bag_shapes(input, offsets, weights, mode, include_last_offset)
    keys = keys_of(input)
    w = None if weights is None else np.ascontiguousarray(weights.detach().reshape(-1).to("cpu", torch.float32)
                                                          .numpy())
    if input.dim() == 2:
        length = int(input.shape[1])
        return keys, np.arange(int(input.shape[0]), dtype=np.int64) * length, w
    assert offsets is not None
    starts = np.ascontiguousarray(offsets.detach().to("cpu", torch.int64).numpy())
    if include_last_offset:
        end = int(starts[-1])
        if not 0 <= end <= keys.shape[0]:
            raise InvalidArgumentError(f"the last offset is {end} but input holds {keys.shape[0]} ids")
        starts, keys = starts[:-1], keys[:end]
        w = None if w is None else w[:end]
    if starts.shape[0]:
        if starts[0] != 0:
            raise InvalidArgumentError(f"offsets[0] must be 0 (the first bag starts the input), got {starts[0]}")
        if (np.diff(starts) < 0).any():
            at = int(np.flatnonzero(np.diff(starts) < 0)[0]) + 1
            raise InvalidArgumentError(f"offsets must not decrease: offsets[{at}] = {starts[at]} < "
                                       f"offsets[{at - 1}] = {starts[at - 1]}")
        if starts[-1] > keys.shape[0]:
            raise InvalidArgumentError(f"offsets[-1] = {starts[-1]} is past the end of input ({keys.shape[0]} ids)")
    return keys, starts, w
