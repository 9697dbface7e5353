"""Write the configuration reference (docs/reference/configuration.md) from the server's config model
(``hps_service.config.HPSConfig``): every key with its type, allowed range, default and description, one table per
section, so the page cannot drift from what ``hps serve`` accepts.

Run ``python docs/gen_config_reference.py --write`` after changing hps_service/config.py; without ``--write`` it exits 1
when the page is stale or a key has no description (``make test`` runs that check).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from hps_service.config import HPSConfig

PAGE = Path(__file__).resolve().parent / "reference" / "configuration.md"

INTRO = """\
# Configuration reference

<!-- Generated from hps_service/config.py by `python docs/gen_config_reference.py --write`: do not edit. -->

One YAML file, validated by one pydantic model (`hps_service/config.py`), configures a server:
`hps serve --config FILE`. Every key can be overridden from the environment as `HPS_<SECTION>__<KEY>` (nested
sections the same way: `HPS_SERVER__GRPC_PORT=9000`, `HPS_VOLATILE__TYPE=disabled`,
`HPS_SERVER__TRACING__ENABLED=true`); the environment wins over the file. A key the model does not know is refused, and
an invalid config stops `hps serve` with exit code 2 and one line naming each bad key, e.g.
`error: invalid configuration (c.yaml): config key 'cache.ways': Input should be a valid integer`.

```yaml
server:     {host: 127.0.0.1, grpc_port: 8500, http_port: 8000, max_batch_keys: 65536}
cache:      {backend: auto, capacity: 0.2, ways: 32, policy: lru, admit_after_misses: 3}
volatile:   {type: hashmap, capacity_rows: 10000000, overflow_policy: lru}
persistent: {type: rocksdb, path: ./var/rocksdb}
updates:    {type: disabled}
cluster:    {shards: 1, shard: 0, partitions: 24}
models:
  - name: demo
    tables:
      - {name: item, dim: 64, default: zeros}          # zeros | {constant: 0.1} | hashed_random
      - {name: user, dim: 32, default: hashed_random}
```

Secrets (`*_token`, `*password`, `*_key`) are better given as their `*_file` twin (a mounted Secret, re-read when it
changes) or from the environment: see [Security](../security.md). The Helm chart's `config` value is this same file.
"""

_CONSTRAINTS = ((annotated_types.Ge, "≥", "ge"), (annotated_types.Gt, ">", "gt"), (annotated_types.Le, "≤", "le"),
                (annotated_types.Lt, "<", "lt"), (annotated_types.MinLen, "length ≥", "min_length"),
                (annotated_types.MaxLen, "length ≤", "max_length"))


@dataclass(frozen=True)
class Key:
    """One leaf of the configuration: its dotted path and what the reference says of it."""

    path: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Section:
    """A table of keys under one heading: a top-level section or a nested model (``server.tls``, ``models[]``)."""

    path: str
    doc: str
    keys: list[Key]


def _section_model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The model a field nests (``X``, ``X | None`` or ``list[X]``) and the suffix its keys' paths take."""
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        nested = _section_model(item)
        return (nested[0], "[]") if nested and not nested[1] else None
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if _is_union(annotation) else [annotation]
    if len(args) == 1 and inspect.isclass(args[0]) and issubclass(args[0], BaseModel):
        return args[0], ""
    return None


def _unwrapped(annotation: Any) -> Any:
    """``annotation`` without ``Annotated[...]`` layers (tags, discriminators)."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _alternatives(annotation: Any) -> list[type[BaseModel]]:
    """The models of a section that is one of several (``volatile``: one backend's settings, by ``type``)."""
    annotation = _unwrapped(annotation)
    if not _is_union(annotation):
        return []
    models = [_unwrapped(a) for a in typing.get_args(annotation)]
    ok = len(models) > 1 and all(inspect.isclass(m) and issubclass(m, BaseModel) for m in models)
    return models if ok else []


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: ``int``, ``"lru" | "lfu"``, ``list[str]``, ``path | null``."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(v) for v in typing.get_args(annotation))
    if _is_union(annotation):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    if inspect.isclass(annotation) and issubclass(annotation, SecretStr):
        return "secret"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "{" + ", ".join(f"{k}: {type_name(f.annotation)}" for k, f in annotation.model_fields.items()) + "}"
    if inspect.isclass(annotation) and issubclass(annotation, Path):
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def constraints(field: FieldInfo) -> str:
    """The field's bounds and pattern, as ``≥ 1, ≤ 1024``."""
    out = []
    for meta in field.metadata:
        for kind, sign, attr in _CONSTRAINTS:
            if isinstance(meta, kind):
                out.append(f"{sign} {getattr(meta, attr)}")
        if getattr(meta, "pattern", None):
            out.append(f"matches `{meta.pattern}`")
    return ", ".join(out)


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it, or *required*."""
    if field.default is PydanticUndefined and field.default_factory is None:
        return "*required*"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return f"`{json.dumps(value, default=str)}`"


def sections(model: type[BaseModel] = HPSConfig, path: str = "", doc: str = "") -> Iterator[Section]:
    """Every section of ``model``, depth first, each with its leaf keys in the model's order."""
    keys, nested = [], []
    for name, field in model.model_fields.items():
        key_path = f"{path}.{name}" if path else name
        for alternative in _alternatives(field.annotation):  # one table per model, each saying which type it is
            kind = type_name(alternative.model_fields["type"].annotation)
            nested.append((alternative, key_path, f"With `type: {kind.strip(chr(34))}`: {inspect.getdoc(alternative)}"))
        if _alternatives(field.annotation):
            continue
        sub = _section_model(field.annotation)
        if sub is not None:
            nested.append((sub[0], key_path + sub[1], field.description or ""))
            continue
        kind = type_name(field.annotation)
        if bounds := constraints(field):
            kind += f" ({bounds})"
        keys.append(Key(key_path, kind, default_text(field), field.description or ""))
    if keys:
        yield Section(path, doc or inspect.getdoc(model) or "", keys)
    for sub_model, sub_path, sub_doc in nested:
        optional = " Optional: unset, the whole section is off." if _is_optional(model, sub_path) else ""
        doc = sub_doc if sub_doc.startswith("With `type") else (inspect.getdoc(sub_model) or sub_doc)
        yield from sections(sub_model, sub_path, doc + optional)


def _is_optional(parent: type[BaseModel], sub_path: str) -> bool:
    field = parent.model_fields[sub_path.rsplit(".", 1)[-1].removesuffix("[]")]
    return _is_union(field.annotation) and type(None) in typing.get_args(field.annotation)


def _cell(text: str) -> str:
    """One table cell: on one line, its pipes escaped and ``<name>`` placeholders shown rather than read as HTML."""
    return " ".join(text.replace("|", "\\|").replace("<", "&lt;").split())


def render() -> str:
    """The whole page."""
    parts = [INTRO]
    for section in sections():
        level = "##" if "." not in section.path.replace("[]", "") else "###"
        which = f" (`{section.doc[6:section.doc.index('`', 6)]}`)" if section.doc.startswith("With `type") else ""
        parts.append(f"\n{level} `{section.path}`{which}\n\n{_cell(section.doc)}\n\n"
                     "| Key | Type | Default | Description |\n| --- | --- | --- | --- |\n")
        parts += [f"| `{k.path}` | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.description)} |\n"
                  for k in section.keys]
    return "".join(parts)


def undocumented() -> list[str]:
    """Keys the model gives no description (each needs one: this page is their documentation)."""
    return [k.path for s in sections() for k in s.keys if not k.description]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/reference/configuration.md")
    args = parser.parse_args(argv)
    missing = undocumented()
    if missing:
        print(f"config keys without a description in hps_service/config.py: {', '.join(missing)}", file=sys.stderr)
        return 1
    expected = render()
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(expected)
        print(f"wrote {PAGE}")
        return 0
    if not PAGE.is_file() or PAGE.read_text() != expected:
        print(f"{PAGE} is stale: run `python docs/gen_config_reference.py --write`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
