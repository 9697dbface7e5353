"""Lint, render and validate the hps Helm chart with Helm's own Go engine (helm-python-sdk), offline.

For the default values and every file in deploy/examples/: ``helm lint --strict``, render, validate each
manifest against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail), load the
rendered server config with the server's own config model under each pod's environment, and check that
probes, Services and policies point at the ports the server opens. Exits 1 on any problem (``make helm-lint``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import yaml

from hps_service.config import ConfigError, HPSConfig, load_config

DEPLOY_DIR = Path(__file__).resolve().parent
CHART_DIR = DEPLOY_DIR / "helm" / "hps"
EXAMPLES_DIR = DEPLOY_DIR / "examples"
RELEASE_NAME = "hps"
NAMESPACE = "ml"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())
LINT_KUBE_VERSION = "v1.33.0"
# Custom resources have no schema in kubernetes-validate; check_consistency covers their fields.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
#: Server config keys that hold secrets: they reach the pod from Secrets, never through the ConfigMap.
SECRET_KEYS = ("admin_token", "password", "sasl_password", "sasl.password", "ssl.key.password", "admin_key", "token",
               "s3_secret_access_key")
_ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class Rendered:
    """The manifests of one render, keyed by kind and name, with the template each came from."""

    docs: list[dict[str, Any]]
    sources: list[str]
    notes: str = ""

    def find(self, kind: str, name: str | None = None) -> list[dict[str, Any]]:
        """Every manifest of ``kind`` (and ``name``, when given)."""
        return [d for d in self.docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        """The single manifest of ``kind``; raises AssertionError when there are none or several."""
        found = self.find(kind, name)
        if len(found) != 1:
            raise AssertionError(f"expected one {kind} {name or ''}, rendered {len(found)}")
        return found[0]


@dataclass
class Report:
    """Problems found in one scenario; empty means the chart passed."""

    scenario: str
    problems: list[str] = field(default_factory=list)

    def add(self, problem: str) -> None:
        self.problems.append(f"{self.scenario}: {problem}")


def load_values(path: Path | None) -> dict[str, Any]:
    """The values in a ``-f`` file (empty for the defaults)."""
    if path is None:
        return {}
    return yaml.safe_load(path.read_text()) or {}


def lint(values: dict[str, Any], report: Report) -> None:
    """``helm lint --strict`` (warnings count as problems) against the schema and templates."""
    result = helm_python.lint(CHART_DIR, values, strict=True, kube_version=LINT_KUBE_VERSION)
    for message in result.get("messages", []):
        if message["severity"] >= 2:
            report.add(f"lint {message['path']}: {message['error']}")
    for error in result.get("errors", []):
        report.add(f"lint: {error}")


def render(values: dict[str, Any], name: str = RELEASE_NAME, namespace: str = NAMESPACE) -> Rendered:
    """Render the chart as ``helm install`` would (offline: ``lookup`` finds nothing)."""
    with helm_python.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name=name, namespace=namespace, is_install=True)
    docs: list[dict[str, Any]] = []
    sources: list[str] = []
    notes = ""
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
                sources.append(template)
    return Rendered(docs, sources, notes)


def validate_schemas(rendered: Rendered, report: Report, versions: tuple[str, ...] = KUBE_VERSIONS) -> None:
    """Validate every manifest against the Kubernetes schemas of each version (strict)."""
    for doc, source in zip(rendered.docs, rendered.sources):
        if (doc.get("apiVersion"), doc.get("kind")) in CUSTOM_KINDS:
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                report.add(f"{source} {doc['kind']} invalid for k8s {version} at {where}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError:
                report.add(f"{source}: no k8s {version} schema for {doc['apiVersion']} {doc['kind']}")


def pod_environment(rendered: Rendered, container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would build it for ``pod_name``.

    fieldRef metadata.name is the pod name, secretKeyRef reads the rendered Secret (or stands in a
    placeholder for an existing one), and ``$(VAR)`` refers to a variable defined earlier.
    """
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), str(var["value"]))
            continue
        source = var.get("valueFrom", {})
        if source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = pod_name
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secrets = rendered.find("Secret", ref["name"])
            if secrets:
                env[var["name"]] = base64.b64decode(secrets[0]["data"][ref["key"]]).decode()
            else:
                env[var["name"]] = f"existing-secret:{ref['name']}/{ref['key']}"
        else:
            raise AssertionError(f"env {var['name']}: unsupported valueFrom {source}")
    return env


@contextlib.contextmanager
def _process_env(env: dict[str, str]) -> Iterator[None]:
    """Run with exactly these HPS_* variables in os.environ (the config model reads them from there)."""
    saved = {k: v for k, v in os.environ.items() if k.upper().startswith("HPS_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.upper().startswith("HPS_")})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.upper().startswith("HPS_")]:
            del os.environ[key]
        os.environ.update(saved)


def statefulset_of(rendered: Rendered, pod_name: str) -> dict[str, Any]:
    """The StatefulSet whose pod ``pod_name`` is (``<statefulset>-<ordinal>``)."""
    return rendered.one("StatefulSet", pod_name.rsplit("-", 1)[0])


def _secret_value(rendered: Rendered, name: str, key: str) -> str:
    """A key of a Secret: the rendered Secret's, or a placeholder naming an existing one."""
    secrets = rendered.find("Secret", name)
    if secrets:
        return base64.b64decode(secrets[0]["data"][key]).decode()
    return f"existing-secret:{name}/{key}"


def mounted_secrets(rendered: Rendered, sts: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """The files Secret volumes (``secret`` with items, or ``projected`` secrets) put into ``container``: path ->
    content (the rendered Secret's value, or a placeholder for an existing Secret)."""
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"].get("volumes", [])}
    files: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})
        sources = [volume["secret"] | {"name": volume["secret"]["secretName"]}] if "secret" in volume else [
            src["secret"] for src in volume.get("projected", {}).get("sources", []) if "secret" in src]
        for source in sources:
            for item in source.get("items", []):
                files[f"{mount['mountPath']}/{item['path']}"] = _secret_value(rendered, source["name"], item["key"])
    return files


def _relocated(value: Any, mounts: dict[str, str]) -> Any:
    """``value`` (a config tree) with each path of a mounted file replaced by where it was written here."""
    if isinstance(value, dict):
        return {k: _relocated(v, mounts) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocated(v, mounts) for v in value]
    return mounts.get(value, value) if isinstance(value, str) else value


def server_config(rendered: Rendered, pod_name: str, environment: bool = True) -> HPSConfig:
    """The config the server in ``pod_name`` loads: the ConfigMap's file under the pod's environment (none with
    ``environment=False``), its ``*_file`` keys reading the files the pod's Secret volumes mount."""
    sts = statefulset_of(rendered, pod_name)
    container = _server_container(sts)
    config_map = rendered.one("ConfigMap")
    env = pod_environment(rendered, container, pod_name) if environment else {}
    with tempfile.TemporaryDirectory() as tmp:
        mounts: dict[str, str] = {}
        for i, (mounted, content) in enumerate(mounted_secrets(rendered, sts, container).items()):
            local = Path(tmp) / f"secret-{i}"
            local.write_text(content)
            mounts[mounted] = str(local)
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(_relocated(yaml.safe_load(config_map["data"]["config.yaml"]), mounts)))
        with _process_env(env):
            return load_config(path)


def _snapshots_path(cfg: HPSConfig) -> Path | None:
    """Where the server writes RocksDB snapshots: server.snapshots_path, by default beside persistent.path."""
    if cfg.persistent.type != "rocksdb":
        return None
    explicit = getattr(cfg.server, "snapshots_path", None)
    return Path(explicit) if explicit else Path(cfg.persistent.path).parent / "snapshots"


def _server_container(sts: dict[str, Any]) -> dict[str, Any]:
    containers = sts["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "hps")


def _resolve_port(container: dict[str, Any], port: int | str) -> int | None:
    if isinstance(port, int):
        return port
    return next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == port), None)


def check_consistency(rendered: Rendered, report: Report) -> None:
    """Check what the schemas cannot: the config loads, probes and Services reach the server's ports,
    each pod has its own consumer group, the grace period covers the drain, RocksDB sits on the volume, and a
    sharded release gives every shard its StatefulSet, its headless Service and its pods their shard."""
    configs: dict[str, list[HPSConfig]] = {}
    for sts in rendered.find("StatefulSet"):
        loaded = _check_statefulset(rendered, sts, report)
        if loaded is None:
            return
        configs[sts["metadata"]["name"]] = loaded
    every = [c for loaded in configs.values() for c in loaded]
    if not every:
        report.add("no StatefulSet rendered")
        return
    groups = [c.updates.group for c in every]
    if every[0].updates.type == "kafka" and (None in groups or len(set(groups)) != len(groups)):
        report.add(f"pods must consume with their own Kafka consumer group, got {groups}")
    _check_shards(rendered, configs, report)
    container = _server_container(rendered.find("StatefulSet")[0])
    _check_secrets(rendered, container, every[0], report)
    _check_policies(rendered, container, report)


def _check_shards(rendered: Rendered, configs: dict[str, list[HPSConfig]], report: Report) -> None:
    """Each StatefulSet's pods serve one shard, every shard has exactly one StatefulSet, its headless Service selects
    only its pods, and NOTES gives the client a target per shard."""
    shards = {c.cluster.shards for loaded in configs.values() for c in loaded}
    if len(shards) != 1:
        report.add(f"pods disagree on cluster.shards: {sorted(shards)}")
        return
    count = shards.pop()
    owner: dict[int, str] = {}
    for name, loaded in configs.items():
        served = {c.cluster.shard for c in loaded}
        if len(served) != 1:
            report.add(f"the pods of StatefulSet {name} serve different shards {sorted(served)}")
            continue
        shard = served.pop()
        if shard in owner:
            report.add(f"StatefulSets {owner[shard]} and {name} both serve shard {shard}")
        owner[shard] = name
    if sorted(owner) != list(range(count)):
        report.add(f"cluster.shards is {count} but the StatefulSets serve shards {sorted(owner)}")
    if count == 1:
        return
    pod_labels = {s["metadata"]["name"]: s["spec"]["template"]["metadata"]["labels"]
                  for s in rendered.find("StatefulSet")}
    for shard, name in owner.items():
        headless = rendered.one("StatefulSet", name)["spec"]["serviceName"]
        service = rendered.find("Service", headless)
        if not service:
            continue  # reported by _check_statefulset
        selector = service[0]["spec"]["selector"]
        selected = [n for n, labels in pod_labels.items() if selector.items() <= labels.items()]
        if selected != [name]:
            report.add(f"headless Service {headless} of shard {shard} selects the pods of {selected}")
        if f"dns:///{headless}." not in rendered.notes:
            report.add(f"NOTES does not give clients the target of shard {shard} ({headless})")


def _check_statefulset(rendered: Rendered, sts: dict[str, Any], report: Report) -> list[HPSConfig] | None:
    """The checks of one StatefulSet (one shard); the configs of two of its pods, None when they do not load."""
    pod_spec = sts["spec"]["template"]["spec"]
    container = _server_container(sts)
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(2)]
    try:
        configs = [server_config(rendered, pod) for pod in pods]
    except ConfigError as exc:
        report.add(f"rendered server config does not load: {exc}")
        return None
    cfg = configs[0]
    server = cfg.server
    if server.host not in ("0.0.0.0", "::"):
        report.add(f"server.host is {server.host}: the server would not accept connections from other pods")

    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if ports.get("grpc") != server.grpc_port:
        report.add(f"container port grpc={ports.get('grpc')} but the server listens on {server.grpc_port}")
    if ports.get("http") != server.http_port:
        report.add(f"container port http={ports.get('http')} but the server listens on {server.http_port}")

    readiness = container.get("readinessProbe", {})
    ready_http = readiness.get("httpGet", {})
    # under (m)TLS kubelet cannot reach the TLS ports: every probe must use the plaintext probe port
    probe_port = server.probe_port if server.tls is not None else server.http_port
    if server.tls is not None and server.probe_port is None:
        report.add("server.tls is set but server.probe_port is not: no probe can pass")
    grpc_ready = server.tls is None and readiness.get("grpc", {}).get("port") == server.grpc_port
    http_ready = ready_http.get("path") == "/readyz" and _resolve_port(container, ready_http.get("port", "")) == \
        probe_port
    if not (grpc_ready or http_ready):
        report.add(f"readiness probe is neither gRPC health on port {server.grpc_port} (plaintext) nor GET /readyz on "
                   f"port {probe_port}: {readiness}")
    for probe_name in ("livenessProbe", "startupProbe"):
        http = container.get(probe_name, {}).get("httpGet", {})
        if http.get("path") != "/healthz" or _resolve_port(container, http.get("port", "")) != probe_port:
            report.add(f"{probe_name} is not GET /healthz on port {probe_port}: {http}")

    for svc in rendered.find("Service"):
        for port in svc["spec"]["ports"]:
            target = _resolve_port(container, port.get("targetPort", port["port"]))
            if target not in (server.grpc_port, server.http_port):
                report.add(f"Service {svc['metadata']['name']} port {port['name']} targets no server port")
        selector = svc["spec"]["selector"]
        if not any(selector.items() <= s["spec"]["template"]["metadata"]["labels"].items()
                   for s in rendered.find("StatefulSet")):
            report.add(f"Service {svc['metadata']['name']} selects no server pod")
    if sts["spec"]["serviceName"] not in {s["metadata"]["name"] for s in rendered.find("Service")
                                          if s["spec"].get("clusterIP") == "None"}:
        report.add(f"the serviceName of StatefulSet {sts['metadata']['name']} is not a rendered headless Service")

    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep_s = float(pre_stop[1]) if len(pre_stop) == 2 and pre_stop[0] == "sleep" else 0.0
    grace = pod_spec.get("terminationGracePeriodSeconds", 30)
    if sleep_s <= 0 or grace <= sleep_s + server.grace_period_s:
        report.add(f"terminationGracePeriodSeconds {grace} must exceed preStop sleep {sleep_s} "
                   f"+ server.grace_period_s {server.grace_period_s}")

    writable = [m for m in container.get("volumeMounts", []) if not m.get("readOnly")]
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    volumes = {v["name"] for v in pod_spec.get("volumes", [])}
    data_dirs = {"persistent.path": cfg.persistent.path if cfg.persistent.type == "rocksdb" else None,
                 "server.snapshots_path": _snapshots_path(cfg)}
    for key, path in data_dirs.items():
        if path is None:
            continue
        mount = next((m for m in writable if Path(path).is_relative_to(m["mountPath"])), None)
        if mount is None or not Path(path).is_absolute():
            report.add(f"{key} {path} is on no writable volume (the root filesystem is read-only)")
        elif mount["name"] not in claims | volumes:
            report.add(f"volume {mount['name']} at {mount['mountPath']} is neither a claim template nor a volume")
    return configs


def _check_secrets(rendered: Rendered, container: dict[str, Any], cfg: HPSConfig, report: Report) -> None:
    """Secrets reach the server from Secrets (env secretKeyRef or mounted files), never through the ConfigMap; no
    manifest but the Secret itself holds a secret, its base64 or its SHA-256; the admin token is a mounted file,
    given to the server exactly when the chart has one."""
    text = rendered.one("ConfigMap")["data"]["config.yaml"]
    for key in SECRET_KEYS:
        if re.search(rf"(^|\s|['\"]){re.escape(key)}['\"]?\s*:", text, re.MULTILINE):
            report.add(f"the ConfigMap holds the secret key {key}")
    others = [(doc, json.dumps(doc)) for doc in rendered.docs if doc["kind"] != "Secret"]
    for secret in rendered.find("Secret"):
        for encoded in secret.get("data", {}).values():
            value = base64.b64decode(encoded).decode()
            traces = {value, encoded, hashlib.sha256(value.encode()).hexdigest()}
            for doc, dumped in others:
                if any(trace in dumped for trace in traces):
                    report.add(f"{doc['kind']} {doc['metadata']['name']} holds a value of Secret "
                               f"{secret['metadata']['name']} (or its base64 or SHA-256)")
    if any(e["name"] in ("HPS_SERVER__ADMIN_TOKEN", "HPS_ADMIN_TOKEN") for e in container.get("env", [])):
        report.add("the admin token reaches the server as an environment variable, not a mounted file")
    if (cfg.server.admin_token is not None) != (cfg.server.admin_token_file is not None):
        report.add("the server's admin token does not come from its mounted file")


def _check_policies(rendered: Rendered, container: dict[str, Any], report: Report) -> None:
    """ServiceMonitor, NetworkPolicy and HPA refer to ports and objects that exist."""
    port_names = {p["name"] for p in container.get("ports", [])}
    services = rendered.find("Service")
    for monitor in rendered.find("ServiceMonitor"):
        selector = monitor["spec"]["selector"].get("matchLabels", {})
        matched = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        if len(matched) != 1:
            report.add(f"ServiceMonitor selects {len(matched)} Services; one target per pod needs exactly one")
        for endpoint in monitor["spec"]["endpoints"]:
            svc_ports = {p["name"] for s in matched for p in s["spec"]["ports"]}
            if endpoint.get("port") not in svc_ports or endpoint.get("path") != "/metrics":
                report.add(f"ServiceMonitor endpoint {endpoint} is not /metrics on a Service port")
    for policy in rendered.find("NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if isinstance(port["port"], str) and port["port"] not in port_names:
                    report.add(f"NetworkPolicy allows named port {port['port']} the container lacks")
    statefulsets = {s["metadata"]["name"]: s for s in rendered.find("StatefulSet")}
    scaled = []
    for hpa in rendered.find("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        if ref["kind"] != "StatefulSet" or ref["name"] not in statefulsets:
            report.add(f"HPA scales {ref}, not one of the StatefulSets {sorted(statefulsets)}")
            continue
        scaled.append(ref["name"])
        if "replicas" in statefulsets[ref["name"]]["spec"]:
            report.add(f"with an HPA the StatefulSet {ref['name']} must not set replicas (every upgrade would reset "
                       "them)")
    if scaled and sorted(scaled) != sorted(statefulsets):
        report.add(f"HPAs scale {sorted(scaled)}, not every StatefulSet {sorted(statefulsets)}")


def scenarios() -> list[tuple[str, Path | None]]:
    """The default values and every example values file."""
    return [("defaults", None)] + [(p.name, p) for p in sorted(EXAMPLES_DIR.glob("*.yaml"))]


def check(name: str, values_path: Path | None) -> Report:
    """Lint, render, validate and cross-check one scenario."""
    report = Report(name)
    values = load_values(values_path)
    lint(values, report)
    try:
        rendered = render(values)
    except helm_python.HelmError as exc:
        report.add(f"render failed: {exc}")
        return report
    validate_schemas(rendered, report)
    check_consistency(rendered, report)
    return report


def main() -> int:
    failed = 0
    for name, path in scenarios():
        report = check(name, path)
        for problem in report.problems:
            print(f"FAIL {problem}")
        failed += bool(report.problems)
        if not report.problems:
            print(f"ok   {name}: lint, render, k8s {' and '.join(KUBE_VERSIONS)} schemas, config and ports")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
