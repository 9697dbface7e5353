"""The Helm chart, rendered by Helm's own Go engine (helm-python-sdk) and checked against Kubernetes schemas.

Each scenario (defaults, every deploy/examples file) is linted strictly, rendered, validated against the
Kubernetes schemas, and its server config loaded with the server's own model. The negative tests show that
each check catches the mistake it exists for.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from pathlib import Path

import helm_python
import pytest
import yaml

from tests.helpers import load_script

REPO = Path(__file__).resolve().parents[2]


_load = load_script


check_chart = _load("check_chart", REPO / "deploy" / "check_chart.py")
values_schema = _load("values_schema", REPO / "deploy" / "values_schema.py")
GPU_EXAMPLE = REPO / "deploy" / "examples" / "values-gpu-redis-kafka.yaml"
ALL_FEATURES = REPO / "deploy" / "examples" / "values-all-features.yaml"
SHARDED = REPO / "deploy" / "examples" / "values-sharded.yaml"


@pytest.fixture(scope="module")
def rendered() -> dict[str, object]:
    """Each scenario rendered once for the module."""
    return {name: check_chart.render(check_chart.load_values(path)) for name, path in check_chart.scenarios()}


def test_scenarios_cover_defaults_and_examples() -> None:
    names = [name for name, _ in check_chart.scenarios()]
    assert names[0] == "defaults"
    assert GPU_EXAMPLE.name in names and ALL_FEATURES.name in names and SHARDED.name in names


@pytest.mark.parametrize("name,path", check_chart.scenarios(), ids=[n for n, _ in check_chart.scenarios()])
def test_chart_lints_renders_and_validates(name: str, path: Path | None) -> None:
    report = check_chart.check(name, path)
    assert report.problems == []


def test_every_template_renders_something_in_some_scenario(rendered: dict) -> None:
    templates = {t.name for t in (REPO / "deploy/helm/hps/templates").glob("*.yaml")}
    with_token = check_chart.render({"adminToken": {"value": "a-token-given-in-values"}})
    produced = {Path(s).name for r in [*rendered.values(), with_token] for s in r.sources}
    assert templates - produced == set()


def test_defaults_install_self_contained(rendered: dict) -> None:
    r = rendered["defaults"]
    cfg = check_chart.server_config(r, "hps-0")
    assert cfg.volatile.type == "hashmap" and cfg.updates.type == "disabled"
    assert cfg.persistent.type == "rocksdb" and str(cfg.persistent.path) == "/var/lib/hps/rocksdb"
    sts = r.one("StatefulSet")
    claims = sts["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["data"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "hps-service:0.1.0"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert not r.find("HorizontalPodAutoscaler") and not r.find("ServiceMonitor") and not r.find("NetworkPolicy")
    services = {s["metadata"]["name"]: s for s in r.find("Service")}
    assert services["hps-headless"]["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == "hps-headless"
    assert sts["spec"]["minReadySeconds"] == 10
    # no token given: nothing generated (the render is the same every time), the admin API is off
    assert not r.find("Secret") and cfg.server.admin_token is None and not r.find("PrometheusRule")
    assert "admin API is disabled" in r.notes


def test_helm_template_renders_the_same_every_time() -> None:
    """A GitOps sync renders the chart with no cluster to look up: two renders must be identical, token included."""
    for values in ({}, {"adminToken": {"value": "s3cret-token-from-values"}}):
        first, second = (check_chart.render(values) for _ in range(2))
        assert first.docs == second.docs
    r = check_chart.render({"adminToken": {"value": "s3cret-token-from-values"}})
    assert base64.b64decode(r.one("Secret")["data"]["admin-token"]).decode() == "s3cret-token-from-values"
    cfg = check_chart.server_config(r, "hps-0")
    assert cfg.server.admin_token is not None and cfg.server.admin_token.get_secret_value() == "s3cret-token-from-values"
    assert "s3cret" not in r.one("ConfigMap")["data"]["config.yaml"]
    annotations = r.one("StatefulSet")["spec"]["template"]["metadata"]["annotations"]
    assert list(annotations) == ["checksum/config"]  # of the ConfigMap's config alone, which holds no secret


SECRETS = {"adminToken": {"value": "s3cret-admin-token-in-values"},
           "auth": {"mode": "token", "readers": [{"name": "ranker", "models": ["demo"]}],
                    "existingSecret": "hps-read-tokens"},
           "tls": {"existingSecret": "hps-tls", "clientAuth": True},
           "kafka": {"enabled": True, "brokers": ["kafka:9092"], "adminKey": {"existingSecret": "hps-admin-key"},
                     "sasl": {"existingSecret": "kafka-scram"}},
           "redisCluster": {"enabled": True, "nodes": ["redis:7000"], "existingSecret": "redis-pass"}}


def _traces(secret: str) -> set[str]:
    """A secret as a manifest could leak it: itself, base64, and its common hashes."""
    raw = secret.encode()
    return {secret, base64.b64encode(raw).decode(), *(hashlib.new(h, raw).hexdigest()
                                                      for h in ("sha256", "sha1", "md5", "sha512"))}


def test_a_rendered_chart_holds_no_secret_and_no_hash_of_one() -> None:
    """Every secret the server gets reaches it as a mounted file (or an env secretKeyRef): no manifest but the chart's
    own Secret holds its value, its base64 or a hash of it; the token is no annotation (a rotated Secret takes effect
    through the file, without a restart)."""
    r = check_chart.render(SECRETS)
    report = check_chart.Report("secrets")
    check_chart.check_consistency(r, report)
    assert report.problems == []
    leaks = [doc["kind"] for doc in r.docs if doc["kind"] != "Secret"
             for trace in _traces("s3cret-admin-token-in-values") if trace in json.dumps(doc)]
    assert leaks == []
    cfg = check_chart.server_config(r, "hps-0")
    assert cfg.server.admin_token.get_secret_value() == "s3cret-admin-token-in-values"
    assert cfg.server.auth == "token" and cfg.server.readers[0].name == "ranker"
    assert cfg.server.readers[0].token.get_secret_value() == "existing-secret:hps-read-tokens/ranker"
    assert cfg.updates.admin_key.get_secret_value() == "existing-secret:hps-admin-key/admin-key"
    written = yaml.safe_load(r.one("ConfigMap")["data"]["config.yaml"])  # paths only
    assert written["server"]["admin_token_file"] == "/etc/hps/secrets/admin-token"
    assert written["server"]["readers"][0]["token_file"] == "/etc/hps/secrets/readers/ranker"
    assert written["updates"]["admin_key_file"] == "/etc/hps/secrets/admin-key"
    assert written["server"]["tls"] == {"cert_file": "/etc/hps/tls/tls.crt", "key_file": "/etc/hps/tls/tls.key",
                                        "client_ca_file": "/etc/hps/tls/ca.crt"}
    pod = r.one("StatefulSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"] == {"secretName": "hps-tls", "defaultMode": 0o440}
    assert [src["secret"]["name"] for src in volumes["secrets"]["projected"]["sources"]] == [
        "hps-admin", "hps-read-tokens", "hps-admin-key"]
    env = {e["name"] for e in pod["containers"][0]["env"]}
    assert not env & {"HPS_SERVER__ADMIN_TOKEN", "HPS_ADMIN_TOKEN", "HPS_UPDATES__ADMIN_KEY"}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["secrets"]["readOnly"] and mounts["tls"]["readOnly"]
    assert _container(r)["readinessProbe"]["httpGet"]["port"] == "probe"  # TLS from the Secret: probes go plaintext


def test_sidecars_run_as_another_user_by_default() -> None:
    """A sidecar may read the store (the pod's fsGroup) but runs as another user than the server's, so it can neither
    write the store nor bind the server's ports beside it; its own securityContext still wins field by field."""
    r = check_chart.render({"sidecars": [{"name": "plain", "image": "busybox"},
                                         {"name": "own", "image": "busybox", "securityContext": {"runAsUser": 20000}}],
                            "config": {"server": {"local": {"enabled": True}}}})
    pod = r.one("StatefulSet")["spec"]["template"]["spec"]
    server_uid = pod["securityContext"]["runAsUser"]
    users = {c["name"]: c["securityContext"].get("runAsUser", server_uid) for c in pod["containers"]}  # effective
    assert users == {"hps": server_uid, "plain": 10002, "own": 20000} and server_uid == 10001
    assert pod["containers"][1]["securityContext"]["allowPrivilegeEscalation"] is False
    cfg = check_chart.server_config(r, "hps-0")
    assert cfg.server.local.group == pod["securityContext"]["fsGroup"]  # readable by the group, writable by none


@pytest.mark.parametrize("config,where", [
    ({"server": {"admin_token": "x"}}, "adminToken.existingSecret"),
    ({"volatile": {"type": "redis_cluster", "nodes": ["redis:6379"], "password": "x"}}, "redisCluster.existingSecret"),
    ({"updates": {"sasl_password": "x"}}, "kafka.sasl.existingSecret"),
    ({"updates": {"kafka_config": {"sasl.password": "x"}}}, "kafka.sasl.existingSecret"),
])
def test_secrets_in_config_values_fail_the_render(config: dict, where: str) -> None:
    values = yaml.safe_load((REPO / "deploy/helm/hps/values.yaml").read_text())["config"]
    for section, keys in config.items():
        values[section] = {**values.get(section, {}), **keys}
    with pytest.raises(helm_python.HelmError, match=where.replace(".", r"\.")):
        check_chart.render({"config": values})


def test_gpu_redis_kafka_example(rendered: dict) -> None:
    r = rendered[GPU_EXAMPLE.name]
    configs = [check_chart.server_config(r, f"hps-{i}") for i in range(3)]
    cfg = configs[0]
    assert cfg.cache.backend == "cupy" and cfg.cache.capacity == 0.25
    assert cfg.volatile.type == "redis_cluster" and len(cfg.volatile.nodes) == 3
    assert cfg.volatile.password is not None  # from the existing Secret named in the example
    assert cfg.updates.type == "kafka" and cfg.updates.brokers.count(":9092") == 3
    assert len({c.updates.group for c in configs}) == 3
    assert all(c.updates.group.endswith(f"hps-{i}") for i, c in enumerate(configs))
    assert [m.name for m in cfg.models] == ["dlrm"]
    sts = r.one("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith(":0.1.0-cuda")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert "replicas" not in sts["spec"]  # the HPA owns the replica count
    hpa = r.one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    monitor = r.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pod["terminationGracePeriodSeconds"] > 10 + cfg.server.grace_period_s


LOCAL_READS = REPO / "deploy" / "examples" / "values-local-reads.yaml"


def test_the_shared_store_lives_on_a_memory_backed_volume_that_sidecars_share(rendered: dict) -> None:
    """Every pod mounts a memory-backed /dev/shm for the node's store (a container's own is 64 MiB); the
    colocated-reads example runs its inference container beside the server on the same volume, in the same fsGroup,
    as another user."""
    for name in ("defaults", LOCAL_READS.name):
        pod = rendered[name].one("StatefulSet")["spec"]["template"]["spec"]
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    r = rendered[LOCAL_READS.name]
    cfg = check_chart.server_config(r, "hps-local-0")
    assert cfg.server.local.enabled and cfg.server.local_socket() == cfg.server.local.path / "grpc.sock"
    assert str(cfg.server.local.path).startswith("/dev/shm/")
    pod = r.one("StatefulSet")["spec"]["template"]["spec"]
    server, inference = pod["containers"]
    assert inference["name"] == "inference"
    assert {"name": "shm", "mountPath": "/dev/shm"} in inference["volumeMounts"]
    assert inference["securityContext"]["runAsUser"] != pod["securityContext"]["runAsUser"]
    assert pod["securityContext"]["fsGroup"] == 10001
    assert next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]["sizeLimit"] == "12Gi"


def test_all_features_example(rendered: dict) -> None:
    r = rendered[ALL_FEATURES.name]
    sts = r.one("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert "volumeClaimTemplates" not in sts["spec"]
    assert {"name": "data", "emptyDir": {}} in pod["volumes"]
    init = pod["initContainers"][0]
    assert "hps import --config /etc/hps/config.yaml" in init["args"][0] and "--if-empty" in init["args"][0]
    assert not r.find("Secret")  # the admin token comes from the existing Secret, as a mounted file
    sources = next(v for v in pod["volumes"] if v["name"] == "secrets")["projected"]["sources"]
    assert sources[0]["secret"] == {"name": "hps-admin-token", "items": [{"key": "token", "path": "admin-token"}]}
    policy = r.one("NetworkPolicy")
    egress_ports = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert egress_ports == {53, 7000, 7001, 9092, 9093}
    assert r.one("PodDisruptionBudget")["spec"] == {
        "minAvailable": 1, "selector": r.one("PodDisruptionBudget")["spec"]["selector"]}
    cfg = check_chart.server_config(r, "hps-full-0")
    assert cfg.server.admin_token.get_secret_value() == "existing-secret:hps-admin-token/token"
    assert [(rd.name, rd.models) for rd in cfg.server.readers] == [("ranker", ["demo"]), ("prometheus", ["*"])]
    assert cfg.updates.admin_key.get_secret_value() == "existing-secret:hps-admin-key/key"
    assert r.one("ServiceMonitor")["spec"]["endpoints"][0]["authorization"]["credentials"]["key"] == "prometheus"
    assert cfg.cache.refresh_interval_s == 60.0  # extraEnv reaches the server
    assert cfg.updates.group == "hps-full.hps-full-0"
    container = pod["containers"][0]
    assert container["image"] == ("registry.example.com/ml/hps-service@sha256:"
                                  "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
    assert sts["spec"]["minReadySeconds"] == 20
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in
            e.get("valueFrom", {})}
    assert refs["HPS_VOLATILE__USERNAME"] == {"name": "redis-acl", "key": "user"}
    assert refs["HPS_VOLATILE__PASSWORD"] == {"name": "redis-acl", "key": "pass"}
    assert refs["HPS_UPDATES__SASL_USERNAME"] == {"name": "kafka-scram", "key": "username"}
    assert refs["HPS_UPDATES__SASL_PASSWORD"] == {"name": "kafka-scram", "key": "password"}
    assert cfg.updates.kafka_config == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                                        "sasl.username": "existing-secret:kafka-scram/username",
                                        "sasl.password": "existing-secret:kafka-scram/password"}
    assert cfg.volatile.username == "existing-secret:redis-acl/user"
    text = r.one("ConfigMap")["data"]["config.yaml"]
    assert "password" not in text and "existing-secret" not in text
    hpa = r.one("HorizontalPodAutoscaler")
    kinds = [m["type"] for m in hpa["spec"]["metrics"]]
    assert kinds == ["Resource", "Pods"] and hpa["spec"]["metrics"][1]["pods"]["metric"]["name"] == \
        "hps_lookups_per_second"
    rule = r.one("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = {a["alert"] for g in rule["spec"]["groups"] for a in g["rules"] if "alert" in a}
    assert alerts == {"HPSUpdateFreshnessSlow", "HPSConsumerLagGrowing", "HPSLookupErrorRatioHigh",
                      "HPSReplicaNotReady", "HPSCacheHitRateCollapsed", "HPSUpdateStreamStalled"}


def test_config_map_is_a_valid_server_config_file(rendered: dict) -> None:
    for r in rendered.values():
        sts = r.find("StatefulSet")[0]["metadata"]["name"]
        check_chart.server_config(r, f"{sts}-0", environment=False)  # valid before any environment override


def test_values_schema_matches_the_config_model() -> None:
    current = json.loads(values_schema.SCHEMA_PATH.read_text())
    assert values_schema.is_current(current), (
        "values.schema.json is stale: run `python deploy/values_schema.py --write`")


@pytest.mark.parametrize("values,complaint", [
    ({"config": {"server": {"grpc_prot": 9000}}}, "grpc_prot"),
    ({"config": {"cache": {"policy": "fifo"}}}, "policy"),
    ({"config": {"server": {"grpc_port": 70000}}}, "grpc_port"),
    ({"kafka": {"enabled": True}}, "brokers"),
    ({"redisCluster": {"enabled": True, "nodes": ["no-port"]}}, "nodes"),
    ({"replicas": 3}, "replicas"),
    ({"gpu": {"enabled": True, "count": 2}}, "count"),  # one device per pod: a second would sit idle
])
def test_schema_rejects_bad_values(values: dict, complaint: str) -> None:
    with pytest.raises(helm_python.HelmError) as exc:
        check_chart.render(values)
    assert complaint in str(exc.value)


@pytest.mark.parametrize("path", ["./var/rocksdb", "/opt/rocksdb", "/var/lib/hpsx/rocksdb"])
def test_rocksdb_path_off_the_volume_fails_the_render(path: str) -> None:
    with pytest.raises(helm_python.HelmError, match="inside persistence.mountPath"):
        check_chart.render({"config": {"persistent": {"path": path}}})


def test_ports_follow_the_config(rendered: dict) -> None:
    r = check_chart.render({"config": {"server": {"grpc_port": 9500, "http_port": 9000}}})
    report = check_chart.Report("ports")
    check_chart.check_consistency(r, report)
    assert report.problems == []
    container = r.one("StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"]["port"] == 9500
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": 9500, "http": 9000}


def test_readiness_through_readyz_when_asked() -> None:
    r = check_chart.render({"probes": {"readinessCheck": "http"}})
    report = check_chart.Report("readyz")
    check_chart.check_consistency(r, report)
    assert report.problems == []
    assert _container(r)["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_tls_probes_use_the_plaintext_probe_port_and_snapshots_reach_the_config() -> None:
    """Under (mutual) TLS kubelet's probes cannot pass on the TLS ports (before, every probe failed): the server opens
    a plaintext probe port and startup, liveness and readiness all use it."""
    tls = {"cert_file": "/etc/hps-tls/tls.crt", "key_file": "/etc/hps-tls/tls.key",
           "client_ca_file": "/etc/hps-tls/ca.crt"}
    r = check_chart.render({"config": {"server": {"tls": tls}},
                            "snapshots": {"store": "s3://hps-snapshots/prod", "intervalSeconds": 600, "retain": 2,
                                          "awsSecret": "hps-s3"}})
    report = check_chart.Report("tls")
    check_chart.check_consistency(r, report)
    assert report.problems == []
    container = _container(r)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["probe"] == 8001
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "probe"}, probe
    assert container["envFrom"] == [{"secretRef": {"name": "hps-s3"}}]
    cfg = check_chart.server_config(r, "hps-0")
    assert cfg.server.probe_port == 8001
    assert (cfg.persistent.snapshot_store, cfg.persistent.snapshot_interval_s, cfg.persistent.snapshot_retain) == (
        "s3://hps-snapshots/prod", 600, 2)
    broken = _mutated(r, lambda x: _container(x)["readinessProbe"]["httpGet"].update(port="http"))
    report = check_chart.Report("tls-broken")
    check_chart.check_consistency(broken, report)
    assert any("readiness probe" in problem for problem in report.problems)


def _mutated(r: object, mutate) -> object:
    clone = copy.deepcopy(r)
    mutate(clone)
    return clone


def _config_set(r: object, section: str, **keys: object) -> None:
    """Change keys of one section of the rendered server config, the rest as rendered."""
    data = r.one("ConfigMap")["data"]  # type: ignore[attr-defined]
    cfg = yaml.safe_load(data["config.yaml"])
    cfg.setdefault(section, {}).update(keys)
    data["config.yaml"] = yaml.safe_dump(cfg)


def _container(r: object) -> dict:
    return r.one("StatefulSet")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("mutation,complaint", [
    (lambda r: _container(r)["readinessProbe"]["grpc"].update(port=9999), "readiness probe"),
    (lambda r: _container(r)["livenessProbe"]["httpGet"].update(path="/"), "livenessProbe"),
    (lambda r: _container(r)["ports"][0].update(containerPort=1234), "container port grpc"),
    (lambda r: r.one("StatefulSet")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=30),
     "terminationGracePeriodSeconds"),
    (lambda r: [e.update(value="fixed-group") for e in _container(r)["env"] if e["name"] == "HPS_UPDATES__GROUP"],
     "consumer group"),
    (lambda r: _container(r)["volumeMounts"].pop(1), "persistent.path"),
    (lambda r: _config_set(r, "persistent", path="/opt/rocksdb"), "persistent.path"),
    (lambda r: _config_set(r, "server", host="127.0.0.1"), "server.host"),
    (lambda r: _config_set(r, "cache", ways=0), "cache.ways"),
])
def test_consistency_check_catches_mistakes(rendered: dict, mutation, complaint: str) -> None:
    broken = _mutated(rendered[GPU_EXAMPLE.name], mutation)
    report = check_chart.Report("broken")
    check_chart.check_consistency(broken, report)
    assert any(complaint in p for p in report.problems), report.problems


def test_kubernetes_schema_validation_catches_mistakes(rendered: dict) -> None:
    def typo(r: object) -> None:
        _container(r)["livenessProbe"]["httpGett"] = _container(r)["livenessProbe"].pop("httpGet")

    def bad_type(r: object) -> None:
        r.one("StatefulSet")["spec"]["replicas"] = "three"

    for mutation, where in ((typo, "livenessProbe"), (bad_type, "replicas")):
        report = check_chart.Report("broken")
        check_chart.validate_schemas(_mutated(rendered["defaults"], mutation), report)
        assert report.problems and all(where in p for p in report.problems), report.problems


def test_notes_tell_how_to_reach_the_service(rendered: dict) -> None:
    notes = rendered["defaults"].notes
    assert "hps.ml.svc:8500" in notes and "port-forward svc/hps" in notes and "/metrics" in notes
    assert "scale statefulset/hps" in notes


def test_sharded_example_is_two_shards_of_two_replicas(rendered: dict) -> None:
    r = rendered[SHARDED.name]
    statefulsets = {s["metadata"]["name"]: s for s in r.find("StatefulSet")}
    assert sorted(statefulsets) == ["hps-shard-0", "hps-shard-1"]
    for shard, (name, sts) in enumerate(sorted(statefulsets.items())):
        assert sts["spec"]["replicas"] == 2
        assert sts["spec"]["serviceName"] == f"{name}-headless"
        assert sts["spec"]["selector"]["matchLabels"]["hps/shard"] == str(shard)
        configs = [check_chart.server_config(r, f"{name}-{i}") for i in range(2)]
        assert {(c.cluster.shards, c.cluster.shard, c.cluster.partitions) for c in configs} == {(2, shard, 24)}
        init = sts["spec"]["template"]["spec"]["initContainers"][0]  # bootstrap imports keep the pod's shard
        assert {"name": "HPS_CLUSTER__SHARD", "value": str(shard)} in init["env"]
        headless = r.one("Service", f"{name}-headless")
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"]["hps/shard"] == str(shard)
        budget = r.one("PodDisruptionBudget", name)
        assert budget["spec"]["selector"]["matchLabels"]["hps/shard"] == str(shard)
    groups = {check_chart.server_config(r, f"hps-shard-{s}-{i}").updates.group for s in (0, 1) for i in (0, 1)}
    assert len(groups) == 4
    assert "hps/shard" not in r.one("Service", "hps")["spec"]["selector"]  # REST and metrics reach every pod
    targets = '["dns:///hps-shard-0-headless.ml.svc:8500","dns:///hps-shard-1-headless.ml.svc:8500"]'
    assert f"HPSClient({targets})" in r.notes and "2 shards x 2 replicas" in r.notes


def test_one_shard_keeps_the_unsharded_names_and_selectors(rendered: dict) -> None:
    r = check_chart.render({"shards": 1, "replicasPerShard": 3})
    sts = r.one("StatefulSet")
    assert sts["metadata"]["name"] == "hps" and sts["spec"]["replicas"] == 3
    assert "hps/shard" not in sts["spec"]["selector"]["matchLabels"]  # selectors are immutable: upgrades work
    assert r.one("Service", "hps-headless") and check_chart.server_config(r, "hps-0").cluster.shards == 1
    assert sts["spec"]["selector"] == rendered["defaults"].one("StatefulSet")["spec"]["selector"]


def test_sharded_autoscaling_scales_each_shard() -> None:
    r = check_chart.render({"shards": 3, "autoscaling": {"enabled": True}})
    refs = sorted(h["spec"]["scaleTargetRef"]["name"] for h in r.find("HorizontalPodAutoscaler"))
    assert refs == ["hps-shard-0", "hps-shard-1", "hps-shard-2"]
    report = check_chart.Report("hpa")
    check_chart.check_consistency(r, report)
    assert report.problems == []


def test_shards_must_divide_the_partitions() -> None:
    with pytest.raises(helm_python.HelmError, match=r"partitions \(24\) must be a multiple of shards \(5\)"):
        check_chart.render({"shards": 5})


@pytest.mark.parametrize("mutation,complaint", [
    (lambda r: r.one("Service", "hps-shard-0-headless")["spec"]["selector"].pop("hps/shard"), "selects the pods of"),
    (lambda r: [e.update(value="0") for s in r.find("StatefulSet") for e in s["spec"]["template"]["spec"]
                ["containers"][0]["env"] if e["name"] == "HPS_CLUSTER__SHARD"], "both serve shard 0"),
    (lambda r: r.docs.remove(r.one("StatefulSet", "hps-shard-1")), "serve shards [0]"),
    (lambda r: setattr(r, "notes", r.notes.replace("hps-shard-1-headless", "x")), "target of shard 1"),
])
def test_consistency_check_catches_sharding_mistakes(rendered: dict, mutation, complaint: str) -> None:
    broken = _mutated(rendered[SHARDED.name], mutation)
    report = check_chart.Report("broken")
    check_chart.check_consistency(broken, report)
    assert any(complaint in p for p in report.problems), report.problems
