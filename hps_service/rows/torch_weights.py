"""Embedding weights as PyTorch saves them, a row source of :mod:`hps_service.rows.sources`: a ``torch.save``'d
state_dict (``.pt``, ``.pth``) or a safetensors file (parsed here without torch or the safetensors package,
memory-mapped and read a slice at a time). One table's rows are found by its name: TorchRec's
``[...]embedding_bags.<table>.weight`` or ``[...]embeddings.<table>.weight``, a module's ``[...]<table>.weight``, or
a tensor named ``<table>``; its row index is the key, unless a keys tensor sits beside it (the weight's name with
``weight`` replaced by ``keys``, or ``<table>.keys``). A file of ``keys`` and ``vectors`` (the ``.npz`` layout) is
read as one table whatever its name."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hps_service.errors import InvalidArgumentError

STATE_DICT_SUFFIXES = (".pt", ".pth")
SAFETENSORS_SUFFIX = ".safetensors"
#: safetensors dtypes NumPy maps directly (BF16 is widened by hand).
_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
                       "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BF16": "<u2"}
#: Largest safetensors header read (the format's own limit is 100 MB).
_MAX_HEADER = 100 << 20



def _same(arr: np.ndarray) -> np.ndarray:
    return arr


@dataclass(frozen=True)
class Tensor:
    """One tensor of a file: ``read()`` its array as stored (memory-mapped where the file allows), ``widen`` a slice
    of it as numbers NumPy computes with (bf16, stored as its upper 16 bits, becomes float32), ``kind`` the NumPy
    kind of the widened values."""

    read: Callable[[], np.ndarray]
    kind: str
    widen: Callable[[np.ndarray], np.ndarray] = _same


#: A file's tensors by name.
Tensors = Mapping[str, Tensor]


def is_torch_weights(path: Path) -> bool:
    """Whether ``path`` names a state_dict or safetensors file (by its suffix)."""
    return path.suffix in (*STATE_DICT_SUFFIXES, SAFETENSORS_SUFFIX)


@dataclass
class WeightsSource:
    """``table``'s rows in a state_dict or safetensors file (see the module), read a slice at a time."""

    path: Path
    table: str | None
    rows: int = 0
    dim: int = 0

    def __post_init__(self) -> None:
        path = self.path
        tensors = safetensors_tensors(path) if path.suffix == SAFETENSORS_SUFFIX else state_dict_tensors(path)
        name = weight_name(path, tensors, self.table)
        self._vectors = tensors[name]
        vectors = self._vectors.read()
        if vectors.ndim != 2 or self._vectors.kind != "f":
            raise InvalidArgumentError(f"{path}: {name} must be 2-D floating point rows, got {vectors.dtype} "
                                       f"{vectors.shape}")
        if vectors.shape[0] == 0:
            raise InvalidArgumentError(f"{path}: {name} holds no rows")
        keys_name = "keys" if name == "vectors" else (name[:-len("weight")] + "keys" if name.endswith(".weight")
                                                      else f"{name}.keys")
        self._keys = tensors.get(keys_name)
        if self._keys is not None:
            keys = self._keys.read()
            if keys.ndim != 1 or self._keys.kind not in "iu":
                raise InvalidArgumentError(f"{path}: {keys_name} must be 1-D integers, got {keys.dtype} "
                                           f"{keys.shape}")
            if keys.shape[0] != vectors.shape[0]:
                raise InvalidArgumentError(f"{path}: {keys.shape[0]} keys in {keys_name} but {vectors.shape[0]} "
                                           f"rows in {name}")
        self.rows, self.dim = int(vectors.shape[0]), int(vectors.shape[1])

    def batches(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(keys int64, vectors float32)`` of at most ``size`` rows each, in file order (row index = key unless
        the file holds keys)."""
        vectors = self._vectors.read()
        keys = None if self._keys is None else self._keys.read()
        for start in range(0, self.rows, size):
            end = min(start + size, self.rows)
            part = np.arange(start, end, dtype=np.int64) if keys is None else keys[start:end]
            yield (np.ascontiguousarray(part, dtype=np.int64),
                   np.ascontiguousarray(self._vectors.widen(vectors[start:end]), dtype=np.float32))


def weight_name(path: Path, tensors: Tensors, table: str | None) -> str:
    """The name of ``table``'s rows among ``tensors``; InvalidArgumentError listing the candidates otherwise."""
    if table:
        rules: list[Callable[[str], bool]] = [
            lambda n: n.endswith((f"embedding_bags.{table}.weight", f"embeddings.{table}.weight")),
            lambda n: n == f"{table}.weight" or n.endswith(f".{table}.weight"),
            lambda n: n == table,
        ]
        for rule in rules:
            found = [n for n in tensors if rule(n)]
            if len(found) > 1:
                raise InvalidArgumentError(f"{path} holds several tensors for table {table!r}: {', '.join(found)}")
            if found:
                return found[0]
    if "keys" in tensors and "vectors" in tensors:
        return "vectors"
    if not table and ("keys" in tensors or "vectors" in tensors):
        lacking = "vectors" if "keys" in tensors else "keys"
        raise InvalidArgumentError(f"{path} lacks the tensor {lacking} (needs keys and vectors, or the table's "
                                   "weights by name)")
    held = ", ".join(list(tensors)[:12]) + (", ..." if len(tensors) > 12 else "")
    wanted = (f"embedding_bags.{table}.weight, {table}.weight or {table}" if table
              else "a table name (the file holds tables by name)")
    raise InvalidArgumentError(f"{path} holds no rows for {wanted}; it holds: {held or 'no tensors'}")


def state_dict_tensors(path: Path) -> Tensors:
    """The tensors of a ``torch.save``'d state_dict (nested dicts' names joined with dots), loaded memory-mapped
    with ``weights_only``: a file that pickles anything but tensors and containers is refused."""
    try:
        import torch
    except ImportError:
        raise InvalidArgumentError(f"{path}: reading a torch state_dict needs PyTorch in the server's environment "
                                   f"(pip install torch), or save the weights as .safetensors") from None
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle's and torch's errors alike: not a loadable state_dict
        raise InvalidArgumentError(f"{path} is not a readable torch state_dict: {exc}") from None
    if not isinstance(loaded, Mapping):
        raise InvalidArgumentError(f"{path} holds a {type(loaded).__name__}, not a state_dict (a dict of tensors)")
    out: dict[str, Tensor] = {}

    def walk(prefix: str, mapping: Mapping[Any, Any]) -> None:
        for k, v in mapping.items():
            if isinstance(v, Mapping):
                walk(f"{prefix}{k}.", v)
            elif isinstance(v, torch.Tensor):
                kind = "f" if v.is_floating_point() else "b" if v.dtype == torch.bool else "i"
                out[f"{prefix}{k}"] = Tensor(_as_numpy(v), kind)

    walk("", loaded)
    return out


def _as_numpy(t: Any) -> Callable[[], np.ndarray]:
    """A reader of tensor ``t`` as NumPy (reduced floats widened to float32)."""
    import torch

    def read() -> np.ndarray:
        x = t.detach()
        if x.is_floating_point() and x.dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        return np.asarray(x.numpy())

    return read


def safetensors_tensors(path: Path) -> Tensors:
    """The tensors of a safetensors file, each memory-mapped when read (BF16 widened to float32)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidArgumentError(f"{path} is not a safetensors file: {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise InvalidArgumentError(f"{path} is not a safetensors file: a header of {n} bytes in {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise InvalidArgumentError(f"{path} is not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise InvalidArgumentError(f"{path} is not a safetensors file: its header is not an object")
    base = 8 + n
    out: dict[str, Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _mapped(path, name, info, base, size)
    return out


def _widen_bf16(arr: np.ndarray) -> np.ndarray:
    return (arr.astype(np.uint32) << 16).view(np.float32)  # bf16 is the upper half of a float32


def _mapped(path: Path, name: str, info: Any, base: int, size: int) -> Tensor:
    """One safetensors entry, memory-mapped when read; InvalidArgumentError when its entry does not describe its
    bytes."""
    try:
        dtype_name, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise InvalidArgumentError(f"{path}: tensor {name} has a malformed header entry {info!r}") from None
    if dtype_name not in _SAFETENSORS_DTYPES:
        raise InvalidArgumentError(f"{path}: tensor {name} is {dtype_name}, which holds no rows or keys")
    dtype = np.dtype(_SAFETENSORS_DTYPES[dtype_name])
    count = int(np.prod(shape, dtype=np.int64))
    if 0 <= start <= end and end - start == count * dtype.itemsize and end > size - base:
        raise InvalidArgumentError(f"{path}: tensor {name} ends past the file's end (cut short?)")
    if not (0 <= start <= end <= size - base) or end - start != count * dtype.itemsize:
        raise InvalidArgumentError(f"{path}: tensor {name} ({dtype_name} {shape}) does not fit bytes {start}..{end}")

    def read() -> np.ndarray:
        if count == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=tuple(shape))

    if dtype_name == "BF16":
        return Tensor(read, "f", _widen_bf16)
    return Tensor(read, dtype.kind)
