"""The JSON bodies of the REST API, their bounds, and how the large ones are parsed.

Keys and rows bodies can be megabytes: they are read as bytes on the event loop (already bounded in size by the
gatekeeper) and parsed by pydantic's JSON parser in FastAPI's thread pool, so a large body never holds up
``/healthz`` or another request's answer. Their lists carry ``max_length`` (server.max_batch_keys, the largest dim),
which the OpenAPI schema shows and a longer list is refused by, as 413 naming the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import AliasChoices, BaseModel, Field, ValidationError

from hps_service.config.base import Storage
from hps_service.errors import ResourceExhaustedError
from hps_service.server.audit import AUDIT_STATE

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
#: The largest dim a table may have (config.TableConfig), so the longest row a body may carry.
MAX_DIM = 16384
#: Bytes a body may spend per key and per float in JSON, compact or with a space after each separator: the longest
#: int64 is 20 characters ("-9223372036854775808"), the longest float32 widened to a double 23
#: ("-1.1754943508222875e-38"), a row's brackets and separator 4; and room for the braces, names and version.
KEY_JSON_BYTES, FLOAT_JSON_BYTES, ROW_JSON_BYTES, BODY_SLACK_BYTES = 22, 25, 4, 4096



class KeyedBody(BaseModel):
    """A body naming keys: the rows routes' (:func:`rows_bodies` bounds their ``keys`` per server)."""

    keys: list[int]


B = TypeVar("B", bound=KeyedBody)
#: A row's version in a body: ``row_version``, or ``version`` as it was first named (not the model's version: that
#: is the ``model_version`` query parameter).
ROW_VERSION = AliasChoices("row_version", "version")
ROW_VERSION_HELP = ("the rows' version (alias: version): a stored row with a newer one is kept; not the model's "
                    "version, which is ?model_version")


def keys_body_bytes(max_keys: int) -> int:
    """The largest body of ``max_keys`` keys (a lookup or a delete)."""
    return max_keys * KEY_JSON_BYTES + BODY_SLACK_BYTES


def bags_body_bytes(max_keys: int) -> int:
    """The largest lookup body of ``max_keys`` keys in as many bags, each key weighted (a pooled lookup)."""
    return max_keys * (2 * KEY_JSON_BYTES + FLOAT_JSON_BYTES) + BODY_SLACK_BYTES


def rows_body_bytes(max_keys: int, dim: int) -> int:
    """The largest body of ``max_keys`` rows of ``dim`` floats (a put)."""
    return max_keys * (KEY_JSON_BYTES + ROW_JSON_BYTES + dim * FLOAT_JSON_BYTES) + BODY_SLACK_BYTES


@dataclass(frozen=True)
class RowsBodies:
    """The body models of the rows routes, their lists bounded by ``server.max_batch_keys``."""

    lookup: type[KeyedBody]
    put: type[KeyedBody]
    delete: type[KeyedBody]


def rows_bodies(max_batch_keys: int) -> RowsBodies:
    """The rows routes' body models for one server (the bound is its config's)."""
    keys_list = Annotated[list[Int64], Field(max_length=max_batch_keys)]

    class LookupBody(KeyedBody):
        """Keys to look up, in the order the rows are wanted (duplicates allowed), up to server.max_batch_keys; with
        ``combiner``, in bags: one row answered per bag (a pooled lookup)."""

        keys: keys_list = Field(description="int64 keys", examples=[[1, 2, 3]])
        offsets: keys_list | None = Field(
            None, description="pooled lookups: each bag's start in keys (the first 0, none decreasing, none past the "
            "keys; as torch's embedding_bag with include_last_offset false); an empty bag answers a zero row")
        combiner: Literal["sum", "mean"] | None = Field(None, description="pooled lookups: how each bag's rows "
                                                        "combine into its row")
        weights: Annotated[list[float], Field(max_length=max_batch_keys)] | None = Field(
            None, description="pooled lookups with combiner sum: one weight per key (default 1)")

    class RowsPut(KeyedBody):
        """Rows to upsert: ``vectors[i]`` is the row of ``keys[i]``; a stored row with a newer version is kept."""

        keys: keys_list
        vectors: Annotated[list[Annotated[list[float], Field(max_length=MAX_DIM)]], Field(max_length=max_batch_keys)]
        row_version: Int64 = Field(0, validation_alias=ROW_VERSION, description=ROW_VERSION_HELP)

    class KeysBody(KeyedBody):
        keys: keys_list
        row_version: Int64 | None = Field(
            None, ge=0, validation_alias=ROW_VERSION, description="the tombstone's row version (alias: version): a "
            "stored row as new or newer is kept, and an older put that lands later stays deleted (default, with Kafka "
            "updates on: the version this replica holds for each key; without: none, the keys are forgotten whatever "
            "their version)")

    return RowsBodies(LookupBody, RowsPut, KeysBody)


#: ``?wait=applied`` also waits until this replica applied a write published to the update topic.
Wait = Annotated[Literal["acknowledged", "applied"], Query(
    description="with Kafka updates on, answer once the broker acknowledged the write (default) or once this "
    "replica also applied it")]


class PurgeTombstonesRequest(BaseModel):
    below_version: int = Field(ge=0, le=2**63 - 1, description="tombstones older than this version are removed; it "
                                                                "must be older than any update the log can still deliver")


class ConvertRequest(BaseModel):
    storage: Storage = Field(description="the format to store the table's rows in: fp32, fp16, bf16 or int8 "
                                         "(row-wise scale and bias)")


class ImportRequest(BaseModel):
    path: str = Field(min_length=1, max_length=4096, description="where the rows are: a server-side path or an "
                      "s3:// URL of a .npz (keys, vectors), a .parquet (key, vector columns), a .safetensors (keys, "
                      "vectors tensors, or the table's weights by name), a torch state_dict (.pt, .pth) or a HugeCTR "
                      "sparse model directory (key, emb_vector)")
    row_version: Int64 = Field(0, validation_alias=ROW_VERSION, description=ROW_VERSION_HELP)


async def _body_bytes(request: Request) -> bytes:
    return await request.body()


def _too_long(exc: ValidationError, max_batch_keys: int) -> ResourceExhaustedError | None:
    """The 413 of a keys or vectors list longer than server.max_batch_keys (pydantic's max_length)."""
    for e in exc.errors():
        if e["type"] == "too_long" and len(e["loc"]) == 1:
            got = e.get("ctx", {}).get("actual_length")
            what = "rows" if e["loc"][0] == "vectors" else "keys"
            return ResourceExhaustedError(f"{got or 'more'} {what} in one request exceeds "
                                          f"server.max_batch_keys={max_batch_keys}")
    return None


def json_body(model: type[B], max_batch_keys: int) -> Any:
    """A FastAPI dependency giving the request's body as ``model``, parsed in the thread pool; the number of keys it
    names goes into the request's audit entry (when the gatekeeper keeps one)."""

    def parse(request: Request, raw: Annotated[bytes, Depends(_body_bytes)]) -> B:
        try:
            body = model.model_validate_json(raw)
        except ValidationError as exc:
            if (limit := _too_long(exc, max_batch_keys)) is not None:
                raise limit from None
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) from None
        entry = getattr(request.state, AUDIT_STATE, None)
        if entry is not None:
            entry.keys = len(body.keys)
        return body

    return Depends(parse)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a route that reads its body with :func:`json_body`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}
