"""REST routes of model versions and labels: add, list and drop versions; point, list and remove labels.

Protocol translation only: the engine serves versions and labels (:mod:`hps_service.engine.versions`), the
registrations carry them to every replica through the registration log when there is one
(:class:`hps_service.fleet.registry_log.ModelRegistrations`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import FastAPI, Path
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from hps_service.config import ModelConfig, TableConfig
from hps_service.config.base import served_name
from hps_service.engine.api import Engine
from hps_service.engine.versions import check_label
from hps_service.fleet.registry_log import ModelRegistrations
from hps_service.server.probes import Readiness
from hps_service.server.rest_models import (
    ADMIN,
    READ,
    AddedVersion,
    DroppedVersion,
    LabelRemoved,
    LabelSet,
    ModelLabels,
    ModelVersion,
    ModelVersions,
    answers,
)


class VersionRequest(BaseModel):
    """A version to add: its number, and its tables (default: the model's)."""

    version: int = Field(ge=1, le=2**31 - 1, description="the version's number (e.g. the training run)")
    tables: list[TableConfig] | None = Field(None, min_length=1, max_length=256,
                                             description="its tables (default: the model's)")


class LabelRequest(BaseModel):
    """The version a label names (0: the model as configured)."""

    version: int = Field(ge=0, le=2**31 - 1)
    allow_empty: bool = Field(False, description="point the label even where a table of the version holds no rows "
                                                 "(refused with 409 otherwise)")


def describe_versions(engine: Engine, model: str) -> dict[str, Any]:
    """The versions of a loaded model (each with its state, source, rows and bytes per table, and when it became
    ready), its labels, and the version a request naming neither reads."""
    engine.model(model)
    _, default = engine.resolve(model)
    return {"model": model, "default_version": default, "labels": engine.labels.of(model),
            "versions": [v.as_json() for v in engine.version_states(model)]}


def add_version_routes(app: FastAPI, engine: Engine, registrations: ModelRegistrations,
                       readiness: Readiness, admin: Sequence[Any]) -> None:
    """Register the version and label routes on ``app`` (``admin``: the dependencies of an admin route)."""

    @app.post("/v1/models/{model}/versions", tags=["versions"], status_code=201, dependencies=admin,
              summary="Add a version of a model, served beside it with tables of its own", operation_id="createVersion",
              response_model=AddedVersion, responses=answers(*ADMIN, 400, 404, 409, 422, 503))
    def create_version(model: str, body: VersionRequest) -> dict[str, Any]:
        base = engine.model(model)
        if served_name(model, body.version) in {m.served_name for m in engine.served_models()}:
            raise HTTPException(409, f"model '{model}' already has version {body.version}")
        config = ModelConfig(name=model, version=body.version, keep_versions=base.keep_versions,
                             tables=body.tables if body.tables is not None else base.tables)
        replicated = registrations.register(config)
        return {**describe_versions(engine, model), "added": body.version, "replicated": replicated}

    @app.get("/v1/models/{model}/versions/{version}", tags=["versions"], operation_id="getVersion",
             summary="One version: its state, source, rows and bytes per table, when it became ready",
             response_model=ModelVersion, responses=answers(*READ, 404, 422))
    def get_version(model: str, version: Annotated[int, Path(ge=1, le=2**31 - 1)]) -> dict[str, Any]:
        engine.model(model)
        found = [v for v in engine.version_states(model) if v.version == version]
        if not found:
            raise HTTPException(404, f"model '{model}' has no version {version}")
        return {"model": model, **found[0].as_json()}

    @app.get("/v1/models/{model}/versions", tags=["versions"], summary="Versions and labels of a model",
             operation_id="listVersions", response_model=ModelVersions, responses=answers(*READ, 404))
    def list_versions(model: str) -> dict[str, Any]:
        return describe_versions(engine, model)

    @app.delete("/v1/models/{model}/versions/{version}", tags=["versions"], dependencies=admin,
                summary="Drop an unlabelled version and free its rows in every tier", operation_id="deleteVersion",
                response_model=DroppedVersion, responses=answers(*ADMIN, 404, 409, 422, 503))
    def delete_version(model: str, version: Annotated[int, Path(ge=1, le=2**31 - 1)]) -> dict[str, Any]:
        names = [k for k, v in engine.labels.of(model).items() if v == version]
        if names:
            raise HTTPException(409, f"version {version} of model '{model}' is labelled ({', '.join(sorted(names))}):"
                                     " point the label elsewhere first")
        replicated = registrations.unload(served_name(model, version))  # NotFoundError for a version not loaded
        return {"model": model, "dropped": version, "replicated": replicated}

    @app.get("/v1/models/{model}/labels", tags=["versions"], summary="Labels of a model", operation_id="listLabels",
             response_model=ModelLabels, responses=answers(*READ, 404))
    def list_labels(model: str) -> dict[str, Any]:
        engine.model(model)
        return {"model": model, "labels": engine.labels.of(model)}

    @app.put("/v1/models/{model}/labels/{label}", tags=["versions"], dependencies=admin,
             summary="Point a label at a version: a switch (or a rollback) that every replica makes at once",
             operation_id="setLabel", response_model=LabelSet, responses=answers(*ADMIN, 400, 404, 409, 422, 503))
    def set_label(model: str, label: str, body: LabelRequest) -> dict[str, Any]:
        check_label(label)
        engine.model(model)
        missing = engine.not_switchable(model, body.version, body.allow_empty)
        not_ready, _ = readiness()
        if missing or not_ready:
            raise HTTPException(409, f"version {body.version} of model '{model}' is not switchable here yet: "
                                     f"{'; '.join([*missing, *not_ready])}")
        before = engine.labels.of(model).get(label)
        replicated = registrations.set_label(model, label, body.version, body.allow_empty)
        return {"model": model, "label": label, "version": body.version, "before": before,
                "replicated": replicated}

    @app.delete("/v1/models/{model}/labels/{label}", tags=["versions"], dependencies=admin,
                summary="Remove a label (a request naming it is then refused with 404)", operation_id="deleteLabel",
                response_model=LabelRemoved, responses=answers(*ADMIN, 400, 404, 503))
    def delete_label(model: str, label: str) -> dict[str, Any]:
        if label not in engine.labels.of(model):
            raise HTTPException(404, f"model '{model}' has no label '{check_label(label)}'")
        replicated = registrations.set_label(model, label, None)
        return {"model": model, "label": label, "removed": True, "replicated": replicated}
