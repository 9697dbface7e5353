"""HugeCTR HPS's parameter server configuration (``ps.json``) as an hps-service config.

:func:`convert` maps every key HPS reads (its Triton backend's, its TensorFlow and PyTorch plugins' ``hps.Init``)
to ours, or says why it has no counterpart; :func:`render` writes the result as YAML with those notes as comments
above the section they concern, so that the reasons stay in the file a reviewer reads. HPS accepts numbers and
booleans written as strings (``"0.5"``, ``"true"``), and so does this converter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hps_service.config.base import NAME_RE
from hps_service.config.hugectr_keys import (
    CACHE_KEYS,
    DEFAULT_TABLE_NAME,
    HPS_HASH_MAP_PARTITIONS,
    MAX_BATCH_KEYS,
    MODEL_KEYS,
    NOT_APPLICABLE_MODEL,
    NOT_APPLICABLE_PERSISTENT,
    NOT_APPLICABLE_TOP,
    NOT_APPLICABLE_UPDATES,
    NOT_APPLICABLE_VOLATILE,
    OVERFLOW_POLICY,
    REDIS_POLICY,
    SECTIONS,
    UNBOUNDED,
    VOLATILE_KEYS,
)


class HugeCTRConfigError(ValueError):
    """The ps.json cannot be converted; the message names the key."""


@dataclass
class SparseImport:
    """A table's sparse model file as the ps.json names it, and where it is on this machine (None: not local)."""

    model: str
    table: str
    given: str
    path: Path | None


@dataclass
class Conversion:
    """Our config (sections as dicts), a note per HPS key under the section it concerns, the sparse files to
    import, and what needs the user's action (for stderr)."""

    config: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=lambda: {s: [] for s in ("top", *SECTIONS)})
    imports: list[SparseImport] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)

    def mapped(self, section: str, key: str, value: Any, ours: str, why: str = "") -> None:
        """Note that HPS's ``key`` (set to ``value``) became ``ours``, and why where it is not plain."""
        self.notes[section].append(f"{key}: {_show(value)} -> {ours}" + (f" ({why})" if why else ""))

    def not_applicable(self, section: str, key: str, value: Any, why: str) -> None:
        """Note that HPS's ``key`` has no counterpart here, and why."""
        self.notes[section].append(f"{key}: {_show(value)} -> not applicable: {why}")


def _show(value: Any) -> str:
    """A value as a note shows it: strings as they are, the rest as flow-style YAML."""
    return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix(
        "\n...").strip()


def _bool(value: Any, key: str) -> bool:
    """A boolean as HPS reads one: true/false, also as strings or 0/1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise HugeCTRConfigError(f"{key}: expected true or false, got {value!r}")


def _number(value: Any, key: str, kind: type[int] | type[float]) -> Any:
    """An int or a float as HPS reads one, also from a string ("64", "0.5")."""
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or (kind is int and not number.is_integer()):
        raise HugeCTRConfigError(f"{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    return int(number) if kind is int else number


def _list(value: Any, key: str) -> list[Any]:
    """A JSON list, or HugeCTRConfigError naming ``key``."""
    if not isinstance(value, list):
        raise HugeCTRConfigError(f"{key}: expected a list, got {value!r}")
    return value


def _unknown(conv: Conversion, section: str, prefix: str, given: dict[str, Any], known: set[str]) -> None:
    """Keys HPS does not read (a typo, or another tool's): listed as ignored."""
    for key in sorted(set(given) - known):
        conv.not_applicable(section, f"{prefix}{key}", given[key], "not a key HPS reads; ignored")


def _name(raw: str, what: str, conv: Conversion, key: str) -> str:
    """A model or table name as ours allow it (letters, digits, _ and -, at most 64), noted when changed."""
    name = re.sub(r"[^A-Za-z0-9_\-]", "_", raw)[:64] or "unnamed"
    if name != raw:
        conv.mapped("models", key, raw, f"{what} {name}", "names here are letters, digits, _ and -")
    assert NAME_RE.match(name)
    return name


def convert(ps: dict[str, Any], base: Path, rocksdb_path: str = "./var/rocksdb") -> Conversion:
    """Map ``ps`` (a parsed ps.json; relative sparse files are taken from ``base``, its directory) to our config,
    with RocksDB at ``rocksdb_path`` (where the sparse files are imported)."""
    if not isinstance(ps, dict):
        raise HugeCTRConfigError("a ps.json holds a JSON object")
    conv = Conversion()
    for key, why in NOT_APPLICABLE_TOP.items():
        if key in ps:
            conv.not_applicable("top", key, ps[key], why)
    models = _list(ps.get("models", []), "models")
    if not models:
        raise HugeCTRConfigError("models: the ps.json names no model")
    conv.config["server"] = {}
    conv.config["models"] = [_model(conv, m, i, base) for i, m in enumerate(models)]
    _cache(conv, models)
    _volatile(conv, ps.get("volatile_db"))
    _persistent(conv, ps.get("persistent_db"), rocksdb_path)
    _updates(conv, ps.get("update_source"))
    _unknown(conv, "top", "", ps, {*NOT_APPLICABLE_TOP, "models", "volatile_db", "persistent_db", "update_source"})
    if not conv.config["server"]:
        del conv.config["server"]
    return conv


def _model(conv: Conversion, m: Any, i: int, base: Path) -> dict[str, Any]:
    """One HPS model: its tables (names, dims, defaults) and the sparse files to import into them."""
    at = f"models[{i}]"
    if not isinstance(m, dict) or "model" not in m:
        raise HugeCTRConfigError(f"{at}: a model needs its name (model)")
    name = _name(str(m["model"]), "model", conv, f"{at}.model")
    sparse = [str(s) for s in _list(m.get("sparse_files", []), f"{at}.sparse_files")]
    if "embedding_vecsize_per_table" not in m:
        raise HugeCTRConfigError(f"{at}.embedding_vecsize_per_table: the dims of the model's tables are needed")
    dims = [_number(d, f"{at}.embedding_vecsize_per_table", int)
            for d in _list(m["embedding_vecsize_per_table"], f"{at}.embedding_vecsize_per_table")]
    raw_names = [str(t) for t in _list(m.get("embedding_table_names", []), f"{at}.embedding_table_names")]
    raw_names += [DEFAULT_TABLE_NAME.format(j + 1) for j in range(len(raw_names), len(dims))]
    defaults = [_number(v, f"{at}.default_value_for_each_table", float)
                for v in _list(m.get("default_value_for_each_table", [0.0]), f"{at}.default_value_for_each_table")]
    if len(defaults) < len(dims):
        conv.mapped("models", f"{at}.default_value_for_each_table", defaults,
                    f"{defaults[0] if defaults else 0.0} for the tables it leaves out",
                    "it names fewer values than tables")
    if len(sparse) != len(dims):
        conv.actions.append(f"{at}.sparse_files names {len(sparse)} files for {len(dims)} tables: the files are "
                            f"imported into the tables in order")
    tables = []
    for j, dim in enumerate(dims):
        table = _name(raw_names[j], "table", conv, f"{at}.embedding_table_names[{j}]")
        value = defaults[j] if j < len(defaults) else (defaults[0] if defaults else 0.0)
        tables.append({"name": table, "dim": dim, "default": "zeros" if value == 0.0 else {"constant": value}})
        if j < len(sparse):
            conv.imports.append(SparseImport(name, table, sparse[j], _local(sparse[j], base)))
    conv.mapped("models", f"{at}.model", m["model"], f"models[{i}].name {name}")
    conv.mapped("models", f"{at}.embedding_table_names", m.get("embedding_table_names", "(unset)"),
                f"models[{i}].tables[].name {[t['name'] for t in tables]}",
                "" if "embedding_table_names" in m else "HPS's default names")
    conv.mapped("models", f"{at}.embedding_vecsize_per_table", dims, f"models[{i}].tables[].dim")
    conv.mapped("models", f"{at}.default_value_for_each_table", m.get("default_value_for_each_table", "(unset)"),
                f"models[{i}].tables[].default {[t['default'] for t in tables]}", "0.0: zeros, else {constant: v}")
    if sparse:
        conv.mapped("models", f"{at}.sparse_files", sparse, "imported into those tables in order (hps config "
                    "from-hugectr --import, or the hps import lines at the end)")
    for key in sorted(m):
        if key in NOT_APPLICABLE_MODEL:
            conv.not_applicable("models", f"{at}.{key}", m[key], NOT_APPLICABLE_MODEL[key])
    _batch_keys(conv, m, at)
    _unknown(conv, "models", f"{at}.", m, MODEL_KEYS | CACHE_KEYS | set(NOT_APPLICABLE_MODEL))
    return {"name": name, "tables": tables}


def _local(given: str, base: Path) -> Path | None:
    """Where a sparse file is here: None for a remote one (hdfs://, s3://, gs://, https://)."""
    if re.match(r"^[a-z][a-z0-9+.\-]*://", given):
        return None
    path = Path(given)
    return path if path.is_absolute() else base / path


def _batch_keys(conv: Conversion, m: dict[str, Any], at: str) -> None:
    """HPS preallocated for max_batch_size samples of maxnum_catfeature_query_per_table_per_sample keys a table."""
    if "max_batch_size" not in m or "maxnum_catfeature_query_per_table_per_sample" not in m:
        for key in ("max_batch_size", "maxnum_catfeature_query_per_table_per_sample"):
            if key in m:
                conv.not_applicable("server", f"{at}.{key}", m[key], "a request's keys are bounded by "
                                    "server.max_batch_keys; nothing is preallocated per request")
        return
    batch = _number(m["max_batch_size"], f"{at}.max_batch_size", int)
    per = [_number(q, f"{at}.maxnum_catfeature_query_per_table_per_sample", int)
           for q in _list(m["maxnum_catfeature_query_per_table_per_sample"],
                          f"{at}.maxnum_catfeature_query_per_table_per_sample")]
    most = batch * max(per, default=1)
    key = f"{at}.max_batch_size x {at}.maxnum_catfeature_query_per_table_per_sample"
    current = conv.config["server"].get("max_batch_keys", MAX_BATCH_KEYS)
    if most > current:
        conv.config["server"]["max_batch_keys"] = most
        conv.mapped("server", key, f"{batch} x {max(per, default=1)}", f"server.max_batch_keys {most}",
                    "the most keys one table's lookup may ask")
    else:
        conv.mapped("server", key, f"{batch} x {max(per, default=1)}", f"{most} keys, within server.max_batch_keys "
                    f"{current}", "nothing is preallocated per request here; set it lower to refuse larger requests")


def _cache(conv: Conversion, models: list[dict[str, Any]]) -> None:
    """gpucache, gpucacheper, hit_rate_threshold and the refresh keys: per model in HPS, one cache section here
    (the first model's values; a model that differs is noted)."""
    first = models[0]
    cache: dict[str, Any] = {}
    if not _bool(first.get("gpucache", True), "models[0].gpucache"):
        cache["enabled"] = False
        conv.mapped("cache", "models[0].gpucache", False, "cache.enabled false", "lookups start at the volatile tier")
    elif "gpucache" in first:
        conv.mapped("cache", "models[0].gpucache", first["gpucache"], "cache.enabled auto (the default)",
                    "an L1 cache per table on the GPU when there is one; on a CPU node none in front of the hash map, "
                    "whose lookups go straight to it as HugeCTR's CPU lookups go to its volatile database")
    share = _number(first.get("gpucacheper", 0.2), "models[0].gpucacheper", float)
    kind = str(first.get("embedding_cache_type", "dynamic"))
    static = _bool(first.get("use_static_table", False), "models[0].use_static_table") or kind == "static"
    if static:
        cache["capacity"] = 1.0
        conv.mapped("cache", "models[0].use_static_table / models[0].embedding_cache_type", "static",
                    "cache.capacity 1.0", "L1 holds every row of a table; they enter it as they are read")
    elif "use_static_table" in first:
        conv.mapped("cache", "models[0].use_static_table", first["use_static_table"], "a dynamic L1 (the default)")
    if kind == "uvm":
        conv.not_applicable("cache", "models[0].embedding_cache_type", kind, "L1 is in device memory (or host "
                            "memory: cache.backend numpy), not unified memory")
    elif kind == "dynamic" and "embedding_cache_type" in first:
        conv.mapped("cache", "models[0].embedding_cache_type", kind, "a dynamic L1 (the default)",
                    "rows enter it as they are read, the least recently used leave")
    if not static and share <= 0:
        cache["enabled"] = False
        conv.mapped("cache", "models[0].gpucacheper", share, "cache.enabled false")
    elif not static:
        cache["capacity"] = min(share, 1.0)
        conv.mapped("cache", "models[0].gpucacheper", share, f"cache.capacity {min(share, 1.0)}",
                    "a fraction of each table's rows")
    elif "gpucacheper" in first:
        conv.not_applicable("cache", "models[0].gpucacheper", share, "a static table's L1 holds every row")
    threshold = _number(first.get("hit_rate_threshold", 0.9), "models[0].hit_rate_threshold", float)
    cache["hit_rate_threshold"] = min(max(threshold, 0.0), 1.0)
    conv.mapped("cache", "models[0].hit_rate_threshold", threshold, f"cache.hit_rate_threshold "
                f"{cache['hit_rate_threshold']}", "above 1 in HPS: every insert synchronous, as 1.0 is here"
                if threshold > 1 else "")
    interval = _number(first.get("refresh_interval", 0), "models[0].refresh_interval", float)
    if interval > 0:
        cache["refresh_interval_s"] = interval
    if "refresh_interval" in first:
        conv.mapped("cache", "models[0].refresh_interval", interval, f"cache.refresh_interval_s {interval}"
                    if interval > 0 else "no periodic refresh (the default)")
    fraction = _number(first.get("cache_refresh_percentage_per_iteration", 0), "models[0].cache_refresh_percentage_"
                       "per_iteration", float)
    if 0 < fraction <= 1:
        cache["refresh_fraction"] = fraction
    if "cache_refresh_percentage_per_iteration" in first:
        conv.mapped("cache", "models[0].cache_refresh_percentage_per_iteration", fraction,
                    f"cache.refresh_fraction {cache.get('refresh_fraction', 0.1)}",
                    "the share read again each cache.refresh_interval_s" + ("" if interval > 0 else
                                                                            ", which is 0 (off), as in HPS"))
    devices = first.get("deployed_device_list", first.get("device_id"))
    if devices is not None:
        conv.mapped("cache", "models[0].deployed_device_list", devices, "cache.backend auto",
                    "L1 goes to the GPU the server sees (CUDA_VISIBLE_DEVICES), else host memory; HPS copied the "
                    "cache to each listed device, here run a server (or a pod) per GPU")
    for i, m in enumerate(models[1:], 1):
        for key in sorted(CACHE_KEYS & set(m)):
            if str(m[key]) == str(first.get(key)):
                conv.mapped("cache", f"models[{i}].{key}", m[key], "as models[0]'s")
            else:
                conv.not_applicable("cache", f"models[{i}].{key}", m[key], "one cache section serves every "
                                    "table here: models[0]'s value is used")
    conv.config["cache"] = cache


def _volatile(conv: Conversion, db: Any) -> None:
    """volatile_db: HPS's hash maps become the hash map tier (a node's processes share it), redis_cluster ours."""
    db = db or {}
    kind = str(db.get("type", "parallel_hash_map"))
    vol: dict[str, Any] = {}
    if kind in ("hash_map", "parallel_hash_map", "multi_process_hash_map"):
        vol["type"] = "hashmap"
        conv.mapped("volatile", "volatile_db.type", kind, "volatile.type hashmap",
                    "shared by the node's worker processes" if kind == "multi_process_hash_map" else "")
        margin = _number(db.get("overflow_margin", UNBOUNDED), "volatile_db.overflow_margin", int)
        parts = _number(db.get("num_partitions", HPS_HASH_MAP_PARTITIONS), "volatile_db.num_partitions", int)
        if margin < UNBOUNDED:
            vol["capacity_rows"] = margin * parts
            conv.mapped("volatile", "volatile_db.overflow_margin x volatile_db.num_partitions", f"{margin} x {parts}",
                        f"volatile.capacity_rows {margin * parts}", "HPS bounded each partition, ours each table")
        else:
            conv.mapped("volatile", "volatile_db.overflow_margin", "unbounded", "volatile.capacity_rows 10000000 "
                        "(the default)", "a bound is required here; raise it, or set volatile.capacity_mb")
        if "num_partitions" in db and margin >= UNBOUNDED:
            conv.not_applicable("volatile", "volatile_db.num_partitions", parts, "parallelism comes from the "
                                "gRPC worker processes (server.workers)")
        policy = str(db.get("overflow_policy", "evict_random"))
        vol["overflow_policy"] = OVERFLOW_POLICY.get(policy, "lru")
        conv.mapped("volatile", "volatile_db.overflow_policy", policy, f"volatile.overflow_policy "
                    f"{vol['overflow_policy']}", "no random eviction here: the least recently used rows go"
                    if policy == "evict_random" else "")
        if "overflow_resolution_target" in db:
            target = _number(db["overflow_resolution_target"], "volatile_db.overflow_resolution_target", float)
            fraction = round(min(max(1.0 - target, 0.01), 0.5), 4)
            vol["overflow_evict_fraction"] = fraction
            conv.mapped("volatile", "volatile_db.overflow_resolution_target", target,
                        f"volatile.overflow_evict_fraction {fraction}", "the share evicted at once, at most 0.5")
    elif kind == "redis_cluster":
        _redis(conv, db, vol)
    else:
        raise HugeCTRConfigError(f"volatile_db.type: {kind!r} is not an HPS volatile database type")
    for key in sorted(db):
        if key in NOT_APPLICABLE_VOLATILE:
            conv.not_applicable("volatile", f"volatile_db.{key}", db[key], NOT_APPLICABLE_VOLATILE[key])
    _unknown(conv, "volatile", "volatile_db.", db, VOLATILE_KEYS | set(NOT_APPLICABLE_VOLATILE))
    if "initialize_after_startup" in db:
        conv.mapped("volatile", "volatile_db.initialize_after_startup", db["initialize_after_startup"],
                    "hps config from-hugectr --import", "the sparse files go into RocksDB once, and every start "
                    "serves them from there")
    conv.config["volatile"] = vol


def _redis(conv: Conversion, db: dict[str, Any], vol: dict[str, Any]) -> None:
    """A Redis Cluster volatile_db: nodes, partitions, user, TLS; its password stays out of the YAML."""
    vol["type"] = "redis_cluster"
    nodes = [a.strip() if ":" in a else f"{a.strip()}:6379" for a in str(db.get("address", "127.0.0.1:7000"))
             .split(",") if a.strip()]
    vol["nodes"] = nodes
    conv.mapped("volatile", "volatile_db.type", "redis_cluster", "volatile.type redis_cluster")
    conv.mapped("volatile", "volatile_db.address", db.get("address", "127.0.0.1:7000"), f"volatile.nodes {nodes}")
    if "num_partitions" in db:
        vol["partitions"] = min(max(_number(db["num_partitions"], "volatile_db.num_partitions", int), 1), 16384)
        conv.mapped("volatile", "volatile_db.num_partitions", db["num_partitions"],
                    f"volatile.partitions {vol['partitions']}", "hashes a table is spread over")
    user = str(db.get("user_name", "default"))
    if user != "default":
        vol["username"] = user
    conv.mapped("volatile", "volatile_db.user_name", user, f"volatile.username {user}" if user != "default" else
                "no volatile.username (Redis's default user)")
    if "password" in db and not db["password"]:
        conv.mapped("volatile", "volatile_db.password", "(empty)", "no volatile.password")
    if db.get("password"):
        conv.not_applicable("volatile", "volatile_db.password", "(set)", "not copied into this file: give it as "
                            "HPS_VOLATILE__PASSWORD or in a file named by volatile.password_file")
        conv.actions.append("volatile_db.password is not copied: set HPS_VOLATILE__PASSWORD or "
                            "volatile.password_file")
    if "enable_tls" in db and not _bool(db["enable_tls"], "volatile_db.enable_tls"):
        conv.mapped("volatile", "volatile_db.enable_tls", False, "volatile.tls false (the default)")
    if _bool(db.get("enable_tls", False), "volatile_db.enable_tls"):
        vol["tls"] = True
        conv.mapped("volatile", "volatile_db.enable_tls", True, "volatile.tls true")
        if "tls_ca_certificate" in db:
            vol["ca_file"] = str(db["tls_ca_certificate"])
            conv.mapped("volatile", "volatile_db.tls_ca_certificate", db["tls_ca_certificate"], "volatile.ca_file")
    for key in ("overflow_margin", "overflow_policy", "overflow_resolution_target"):
        if key in db:
            policy = REDIS_POLICY.get(str(db.get("overflow_policy", "evict_random")), "allkeys-lru")
            conv.not_applicable("volatile", f"volatile_db.{key}", db[key], "the Redis tier does not count rows: "
                                f"bound the cluster with maxmemory and maxmemory-policy {policy}")


def _persistent(conv: Conversion, db: Any, rocksdb_path: str) -> None:
    """RocksDB always: the sparse files are imported into it, whether or not HPS kept one."""
    db = db or {}
    kind = str(db.get("type", "disabled"))
    conv.config["persistent"] = {"type": "rocksdb", "path": rocksdb_path}
    if kind == "rocks_db":
        conv.mapped("persistent", "persistent_db.type", kind, "persistent.type rocksdb")
        conv.mapped("persistent", "persistent_db.path", db.get("path", "/tmp/rocksdb"),
                    f"persistent.path {rocksdb_path}", "HPS's RocksDB holds HPS's format: a new one, filled by "
                    "the import")
    elif kind == "disabled":
        conv.mapped("persistent", "persistent_db.type", kind, f"persistent.type rocksdb at {rocksdb_path}",
                    "HPS loaded the sparse files into the volatile database at every start; here they are imported "
                    "once into RocksDB, which holds every row")
        if "path" in db:
            conv.not_applicable("persistent", "persistent_db.path", db["path"], "HPS's persistent database was off")
    else:
        raise HugeCTRConfigError(f"persistent_db.type: {kind!r} is not an HPS persistent database type")
    if _bool(db.get("read_only", False), "persistent_db.read_only"):
        conv.mapped("persistent", "persistent_db.read_only", True, "persistent.read_only false for the import",
                    "set it to true once the sparse files are imported")
    elif "read_only" in db:
        conv.mapped("persistent", "persistent_db.read_only", db["read_only"], "persistent.read_only false")
    for key in sorted(db):
        if key in NOT_APPLICABLE_PERSISTENT:
            conv.not_applicable("persistent", f"persistent_db.{key}", db[key], NOT_APPLICABLE_PERSISTENT[key])
    _unknown(conv, "persistent", "persistent_db.", db, {"type", "path", "read_only", *NOT_APPLICABLE_PERSISTENT})


def _updates(conv: Conversion, src: Any) -> None:
    """update_source: Kafka brokers carry over; HugeCTR's message format and topics do not."""
    src = src or {}
    kind = str(src.get("type", "null"))
    if kind in ("null", "none", ""):
        conv.config["updates"] = {"type": "disabled"}
        if src:
            conv.mapped("updates", "update_source.type", kind, "updates.type disabled")
        return
    if kind != "kafka_message_queue":
        raise HugeCTRConfigError(f"update_source.type: {kind!r} is not an HPS update source type")
    brokers = ",".join(b.strip() for b in str(src.get("brokers", "127.0.0.1:9092")).split(";") if b.strip())
    updates: dict[str, Any] = {"type": "kafka", "brokers": brokers, "topic_prefix": "hps"}
    conv.mapped("updates", "update_source.type", kind, "updates.type kafka")
    conv.mapped("updates", "update_source.brokers", src.get("brokers", "127.0.0.1:9092"), f"updates.brokers {brokers}")
    if "metadata_refresh_interval_ms" in src:
        interval = _number(src["metadata_refresh_interval_ms"], "update_source.metadata_refresh_interval_ms", int)
        updates["kafka_config"] = {"topic.metadata.refresh.interval.ms": interval}
        conv.mapped("updates", "update_source.metadata_refresh_interval_ms", interval,
                    "updates.kafka_config topic.metadata.refresh.interval.ms", "librdkafka's own setting")
    for key in sorted(src):
        if key in NOT_APPLICABLE_UPDATES:
            conv.not_applicable("updates", f"update_source.{key}", src[key], NOT_APPLICABLE_UPDATES[key])
    _unknown(conv, "updates", "update_source.", src, {"type", "brokers", "metadata_refresh_interval_ms",
                                                       *NOT_APPLICABLE_UPDATES})
    conv.notes["updates"].append("HugeCTR's trainer wrote its own message format to a topic per table "
                                 "(hps_et.<model>.<table>); these servers read hps-service update messages from "
                                 "hps.<model>: publish them with hps_service.updates.Publisher, or hps train")
    conv.actions.append("update_source: HugeCTR's Kafka messages are not read here; publish updates to hps.<model> "
                        "with hps_service.updates.Publisher (docs/migrating-from-hugectr.md)")
    conv.config["updates"] = updates


def render(conv: Conversion, source: str, config_name: str = "hps.yaml") -> str:
    """The converted config as YAML, each section after the notes on the HPS keys that went into it (or why they
    did not), and the import commands of the sparse files at the end."""
    out = [f"# hps-service configuration converted from HugeCTR HPS's {source} by `hps config from-hugectr`.",
           "# Above each section: every HPS key it took (->), or why the key has no counterpart here.", "#"]
    out += [f"# {note}" for note in conv.notes["top"]]
    for section in SECTIONS:
        if section not in conv.config and not conv.notes[section]:
            continue
        out.append("")
        out += [f"# {note}" for note in conv.notes[section]]
        if section not in conv.config:
            out.append(f"# ({section}: the defaults)")
            continue
        out.append(yaml.safe_dump({section: conv.config[section]}, sort_keys=False, default_flow_style=None,
                                  width=120).rstrip())
    if conv.imports:
        out += ["", "# The sparse files, imported into RocksDB (or all at once: hps config from-hugectr --import):"]
        for imp in conv.imports:
            where = str(imp.path) if imp.path is not None else f"{imp.given}  # remote: copy it here first"
            out.append(f"#   hps import --config {config_name} --model {imp.model} --table {imp.table} {where}")
    return "\n".join(out) + "\n"
