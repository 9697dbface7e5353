"""Row formats: each stored row decodes within its format's error bound, at the edges of its range too."""

from __future__ import annotations

import numpy as np
import pytest

from hps_service.errors import InvalidArgumentError
from hps_service.rows import STORAGES, row_format
from hps_service.rows.formats import FP16_MAX


def random_rows(n: int, dim: int, seed: int = 0, spread: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, dim)) * spread).astype(np.float32)


def half_ulp_bound(x: np.ndarray, mantissa_bits: int) -> np.ndarray:
    """Half the spacing of a float with ``mantissa_bits`` explicit bits at |x| (the round-to-nearest error bound)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(x), np.float32(2.0**-14))))
    return 2.0 ** (exponent - mantissa_bits) / 2


@pytest.mark.parametrize("dim", [1, 3, 8, 64, 65])
def test_words_hold_the_stored_row(dim: int) -> None:
    assert row_format("fp32", dim).words == dim
    assert row_format("fp16", dim).words == row_format("bf16", dim).words == (dim + 1) // 2
    assert row_format("int8", dim).words == (dim + 3) // 4 + 2
    for storage in STORAGES:
        fmt = row_format(storage, dim)
        assert fmt.encode(random_rows(5, dim)).shape == (5, fmt.words)


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_fp16_within_half_an_ulp(dim: int) -> None:
    fmt = row_format("fp16", dim)
    x = random_rows(500, dim, spread=100.0)
    got = fmt.decoded(fmt.encode(x))
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
    assert (np.abs(got - x) <= half_ulp_bound(x, 10)).all()


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_bf16_within_half_an_ulp_round_to_nearest_even(dim: int) -> None:
    fmt = row_format("bf16", dim)
    x = random_rows(500, dim, spread=1e20)
    got = fmt.decoded(fmt.encode(x))
    assert (np.abs(got.astype(np.float64) - x) <= half_ulp_bound(x.astype(np.float64), 7)).all()
    ties = np.array([[1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]], dtype=np.float32)  # exactly halfway: to the even one
    np.testing.assert_array_equal(row_format("bf16", 2).decoded(row_format("bf16", 2).encode(ties)),
                                  [[1.0, 1.0 + 4 * 2.0**-8]])


@pytest.mark.parametrize("dim", [1, 5, 64, 129])
def test_int8_within_half_a_step_of_the_rows_range(dim: int) -> None:
    fmt = row_format("int8", dim)
    x = random_rows(400, dim, spread=3.0)
    x[0] = 7.5  # a constant row: its range is 0, answered exactly
    got = fmt.decoded(fmt.encode(x))
    scale = (x.max(axis=1) - x.min(axis=1)) / 255
    slack = 4 * np.spacing(np.abs(x).max(axis=1))  # float32 rounding of code * scale + bias
    assert (np.abs(got - x).max(axis=1) <= scale / 2 + slack).all()
    np.testing.assert_array_equal(got[0], 7.5)
    np.testing.assert_array_equal(got.min(axis=1), x.min(axis=1))  # the bias is the row's minimum


def test_decoding_again_gives_the_same_stored_row_for_16_bit_formats() -> None:
    for storage in ("fp16", "bf16"):
        fmt = row_format(storage, 64)
        stored = fmt.encode(random_rows(100, 64))
        np.testing.assert_array_equal(fmt.encode(fmt.decoded(stored)).view(np.uint32), stored.view(np.uint32))


def test_fp16_refuses_a_row_beyond_its_range_and_keeps_its_edge() -> None:
    fmt = row_format("fp16", 2)
    edge = np.array([[FP16_MAX, -FP16_MAX]], dtype=np.float32)
    np.testing.assert_array_equal(fmt.decoded(fmt.encode(edge)), edge)
    with pytest.raises(InvalidArgumentError, match="fp16's range"):
        fmt.encode(np.array([[70000.0, 0.0]], dtype=np.float32))


def test_empty_batches_and_an_unknown_storage() -> None:
    for storage in STORAGES:
        fmt = row_format(storage, 4)
        assert fmt.decoded(fmt.encode(np.empty((0, 4), np.float32))).shape == (0, 4)
    with pytest.raises(InvalidArgumentError, match="unknown row storage 'int4'"):
        row_format("int4", 4)


def test_fp16_decode_is_bit_exact_with_numpy_for_every_half() -> None:
    """Every one of the 65536 halves (subnormals, +-0, infinities, NaN payloads) decodes to NumPy's float32 bits."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    fmt = row_format("fp16", 1 << 16)
    got = fmt.decoded(halves.view(np.float32).reshape(1, -1))
    np.testing.assert_array_equal(got.view(np.uint32)[0], halves.view(np.float16).astype(np.float32).view(np.uint32))
