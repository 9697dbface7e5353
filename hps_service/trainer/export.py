"""The dense tower as a versioned artifact: ``<dest>/v<version>/model.safetensors`` + ``config.json``.

``config.json`` holds the DLRM config (tables, layer sizes, MoE), the row version and step it was trained to, the
model name and how raw features become inputs; it is written last, so an artifact without it is incomplete and
never loaded. ``<dest>`` is a directory or ``s3://bucket/prefix`` (boto3; endpoint and credentials from the usual
AWS environment, e.g. ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from hps_service.errors import InvalidArgumentError, NotFoundError
from hps_service.trainer.model import DenseTower, DLRMConfig, TableSpec
from hps_service.trainer.moe import MoEConfig

FORMAT = "hps-dense-tower/1"


def artifact_name(version: int) -> str:
    return f"v{version:020d}"


def config_to_dict(config: DLRMConfig) -> dict[str, Any]:
    out = asdict(config)
    out["tables"] = [asdict(t) for t in config.tables]
    return out


def config_from_dict(data: dict[str, Any]) -> DLRMConfig:
    moe = MoEConfig(**data["moe"]) if data.get("moe") else None
    return DLRMConfig(
        tables=tuple(TableSpec(**t) for t in data["tables"]), num_dense=data["num_dense"],
        bottom_hidden=tuple(data["bottom_hidden"]), top_hidden=tuple(data["top_hidden"]),
        interaction_dim=data.get("interaction_dim"), moe=moe, moe_hidden=data["moe_hidden"],
        interaction=data.get("interaction", "dot"), dcn_layers=data.get("dcn_layers", 2),
    )


def _s3(dest: str) -> tuple[Any, str, str]:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise InvalidArgumentError("an s3:// export needs boto3 (pip install boto3)") from None
    bucket, _, prefix = dest[len("s3://"):].partition("/")
    if not bucket:
        raise InvalidArgumentError(f"{dest!r}: expected s3://bucket/prefix")
    # S3-compatible servers named by AWS_ENDPOINT_URL (MinIO, SeaweedFS, ...) want path-style addressing
    custom = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(s3={"addressing_style": "path" if custom else "auto"},
                    retries={"max_attempts": 5, "mode": "standard"},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return boto3.client("s3", config=config), bucket, prefix.strip("/")


def export_tower(
    dest: str, tower: DenseTower, model: str, version: int, step: int, features: dict[str, Any]
) -> str:
    """Write the tower as artifact ``version`` under ``dest``; returns where it went."""
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tower.state_dict().items()}
    blob = save_safetensors(state)
    meta = {"format": FORMAT, "model": model, "version": version, "step": step, "features": features,
            "dlrm": config_to_dict(tower.config)}
    name = artifact_name(version)
    if dest.startswith("s3://"):
        client, bucket, prefix = _s3(dest)
        key = f"{prefix}/{name}" if prefix else name
        client.put_object(Bucket=bucket, Key=f"{key}/model.safetensors", Body=blob)
        client.put_object(Bucket=bucket, Key=f"{key}/config.json", Body=json.dumps(meta, indent=2).encode())
        return f"s3://{bucket}/{key}"
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / name, root / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(blob)
    (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return str(final)


def latest_version(dest: str) -> int | None:
    """The newest complete artifact's version under ``dest``, or None."""
    if dest.startswith("s3://"):
        client, bucket, prefix = _s3(dest)
        versions = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/v" if prefix
                                                                       else "v"):
            for obj in page.get("Contents", []):
                parts = obj["Key"].split("/")
                if parts[-1] == "config.json" and parts[-2].startswith("v") and parts[-2][1:].isdigit():
                    versions.append(int(parts[-2][1:]))
        return max(versions) if versions else None
    root = Path(dest)
    if not root.is_dir():
        return None
    done = [int(p.name[1:]) for p in root.iterdir()
            if p.name.startswith("v") and p.name[1:].isdigit() and (p / "config.json").is_file()]
    return max(done) if done else None


def load_tower(dest: str, version: int | None = None) -> tuple[DenseTower, dict[str, Any]]:
    """The tower of artifact ``version`` (default: the newest) in eval mode on the CPU, and its config.json."""
    version = latest_version(dest) if version is None else version
    if version is None:
        raise NotFoundError(f"no exported model under {dest}")
    name = artifact_name(version)
    if dest.startswith("s3://"):
        client, bucket, prefix = _s3(dest)
        key = f"{prefix}/{name}" if prefix else name
        meta = json.loads(client.get_object(Bucket=bucket, Key=f"{key}/config.json")["Body"].read())
        blob = client.get_object(Bucket=bucket, Key=f"{key}/model.safetensors")["Body"].read()
    else:
        path = Path(dest) / name
        meta = json.loads((path / "config.json").read_text())
        blob = (path / "model.safetensors").read_bytes()
    if meta.get("format") != FORMAT:
        raise InvalidArgumentError(f"{dest}/{name} is not a {FORMAT} artifact")
    tower = DenseTower(config_from_dict(meta["dlrm"]))
    tower.load_state_dict(load_safetensors(blob))
    tower.eval()
    return tower, meta
