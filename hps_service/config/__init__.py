"""The whole service configuration as one typed pydantic model.

Loaded from a YAML file; every key can be overridden from the environment as ``HPS_<SECTION>__<KEY>``
(e.g. ``HPS_SERVER__GRPC_PORT=9000``). Environment values win over the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from hps_client.rows import row_words
from hps_service.config.base import NAME_PATTERN, NAME_RE, Storage, served_name
from hps_service.config.base import Section as _Section
from hps_service.config.cache import CacheConfig as CacheConfig
from hps_service.config.repository import RepositoryConfig as RepositoryConfig
from hps_service.config.secrets import load_secret_files
from hps_service.config.security import AuthMode, InternalListener, ReaderConfig, check_auth
from hps_service.config.tiers import VOLATILE_TYPES
from hps_service.config.tiers import HashMapVolatile as HashMapVolatile
from hps_service.config.tiers import NoVolatile as NoVolatile
from hps_service.config.tiers import PersistentConfig as PersistentConfig
from hps_service.config.tiers import RedisClusterVolatile as RedisClusterVolatile
from hps_service.config.tiers import VolatileConfig as VolatileConfig
from hps_service.runtime.cpus import usable_cpus


class TLSConfig(_Section):
    """TLS for both listeners (gRPC and REST); with ``client_ca_file`` clients must present a certificate it signed."""

    cert_file: Path = Field(description="PEM certificate chain of the server")
    key_file: Path = Field(description="PEM private key of the server")
    client_ca_file: Path | None = Field(None, description="PEM CA bundle; when set, mutual TLS is required")


class LocalStoreConfig(_Section):
    """Colocated reads: the node's shared store at a fixed path that LocalClient processes of the pod map."""

    enabled: bool = Field(False, description="keep the store at ``path`` for LocalClient readers")
    path: Path = Field(Path("/dev/shm/hps"), description="directory of the shared store (memory-backed)")
    group: str | int | None = Field(None, description="the group (name or gid) of the colocated readers: the store "
                                    "is then 0750/0640 with that group, the socket 0660; unset: 0700/0600, owner only")


class TracingConfig(_Section):
    """OpenTelemetry spans of gRPC and REST calls, exported over OTLP/gRPC (needs the ``otel`` extra). Off by default,
    and then nothing of it runs on a call: no interceptor, no middleware, no span, no request id."""

    enabled: bool = Field(False, description="trace gRPC and REST calls (needs the otel extra)")
    endpoint: str | None = Field(
        None, pattern=r"^https?://[^\s/]+(/.*)?$", description="OTLP/gRPC collector, e.g. http://otel-collector:4317 "
        "(https:// for TLS); default OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else "
        "http://localhost:4317. Headers (e.g. a vendor's key) come from OTEL_EXPORTER_OTLP_HEADERS, never the file")
    service_name: str = Field("hps-service", min_length=1, max_length=128, description="the spans' service.name")
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="share of calls without a caller's trace decision that are traced; a "
        "caller's sampled (or not) traceparent is always followed")
    export_interval_s: float = Field(1.0, gt=0, le=60, description="a process exports its finished spans this often")


class ServerConfig(_Section):
    """Network endpoints and request limits."""

    host: str = Field("127.0.0.1", description="address gRPC and REST listen on (0.0.0.0 in a container)")
    grpc_port: int = Field(8500, ge=0, le=65535, description="gRPC port (0: a free one, logged)")
    http_port: int = Field(8000, ge=0, le=65535, description="REST admin API and /metrics port (0: a free one)")
    admin_token: SecretStr | None = Field(None, description="bearer token of the admin routes (or HPS_ADMIN_TOKEN); unset: they answer 403")
    admin_token_file: Path | None = Field(
        None, description="a file holding the admin token (a mounted Secret; re-read when it changes)")
    auth: AuthMode = Field(
        "none", description="reads (gRPC lookups, REST reads): none, token (a bearer token of server.readers) or "
        "mtls (the client certificate's identity, per server.readers); admin routes always need the admin token")
    readers: list[ReaderConfig] = Field(default_factory=list, description="who may read which models")
    audit_log: Path | None = Field(
        None, description="also append the audit log (one JSON line per admin action) to this file")
    expose_internal_on: list[InternalListener] = Field(
        default_factory=lambda: list[InternalListener](["http"]), description="where /metrics, /docs, /v1/stats, /v1/jobs and "
        "/v1/cache are served: the REST port (http) and/or the probe port (probe, server.probe_port); on the REST "
        "port they need a read credential when server.auth is on")
    max_batch_keys: int = Field(65536, ge=1, description="keys per request; more: RESOURCE_EXHAUSTED / 413")
    max_tables_per_request: int = Field(64, ge=1, description="tables per Lookup; more: RESOURCE_EXHAUSTED")
    workers: int | None = Field(
        None, ge=0, le=1024, description="gRPC worker processes sharing the gRPC port (SO_REUSEPORT) and one copy of "
        "L1 and the hash map in shared memory; default: the CPUs this process may use (cgroup limit, else affinity); "
        "0 serves gRPC from the owner process itself (one GIL)")
    grpc_workers: int | None = Field(
        None, ge=1, description="gRPC handler threads per serving process; default: 2 with worker processes, else "
        "the CPU cores, at least 2 (more threads only contend for the GIL: measured 12% fewer keys/s with 8 than "
        "with 2 on 2 cores)"
    )
    uds_path: Path | None = Field(
        None, description="also serve gRPC on this Unix domain socket (from the owner process; LocalClient sends "
        "its misses there); default with server.local enabled: <local.path>/grpc.sock")
    local: LocalStoreConfig = Field(default_factory=lambda: LocalStoreConfig())
    grace_period_s: float = Field(30.0, ge=0, description="SIGTERM waits this long for calls in flight")
    max_concurrent_requests: int = Field(256, ge=1, description="gRPC calls in flight; more get RESOURCE_EXHAUSTED")
    max_streams: int = Field(
        16, ge=1, description="StreamLookup and reflection streams open at once per serving process (the owner, or "
        "each worker); more get RESOURCE_EXHAUSTED. Each runs on a thread of its own beside the grpc_workers handler "
        "threads (and is not counted in max_concurrent_requests), so open streams never delay a unary call")
    max_streams_per_caller: int | None = Field(
        None, ge=1, description="streams one caller (its reader name with server.auth on, else its address) may "
        "hold open per serving process; more get RESOURCE_EXHAUSTED; default: a quarter of max_streams, at least 1")
    stream_idle_timeout_s: float = Field(
        60.0, gt=0, description="a StreamLookup or reflection stream with no message either way for this long is "
        "closed with DEADLINE_EXCEEDED naming this key")
    max_watches: int = Field(
        1024, ge=1, description="health Watch streams open at once per serving process (hps-client keeps one per "
        "connection; a Watch holds no thread); more get RESOURCE_EXHAUSTED, and one caller may hold a quarter")
    max_calls_per_connection: int = Field(
        16, ge=1, le=10000, description="gRPC calls in flight on one connection (HTTP/2 max concurrent streams): a "
        "client's further calls wait for one to end, and a peer that stops reading holds at most this many answers "
        "of the server")
    max_connection_age_s: float = Field(
        300.0, ge=0, description="gRPC connections are closed (GOAWAY, with gRPC's 10% jitter) after this long, so "
        "clients reconnect and reach new replicas; 0: never")
    max_connection_age_grace_s: float = Field(
        30.0, ge=0, description="calls still running on a connection past its age get this long to finish")
    keepalive_time_s: float = Field(60.0, gt=0, description="ping an idle client connection this often")
    keepalive_timeout_s: float = Field(20.0, gt=0, description="drop a connection whose ping is not answered in time")
    min_client_ping_interval_s: float = Field(
        10.0, gt=0, description="clients may send keepalive pings this often (hps-client pings every 30 s)")
    snapshots_path: Path | None = Field(None, description="RocksDB checkpoints; default: <persistent.path>/../snapshots")
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="REST request bodies larger get 413")
    max_message_bytes: int | None = Field(
        None, ge=1024, description="gRPC requests larger get RESOURCE_EXHAUSTED; default: sized from max_batch_keys"
    )
    tls: TLSConfig | None = Field(None, description="TLS on both ports (unset: plaintext)")
    heap_trim_interval_s: float = Field(
        30.0, ge=0, description="return the C heap's free memory to the operating system this often (glibc "
        "malloc_trim, in the owner and each worker), so resident memory follows live memory under a steady update "
        "stream; 0: never")
    log_format: Literal["text", "json"] = Field(
        "text", description="stderr log lines as text, or one JSON object per line (librdkafka and uvicorn too)")
    tracing: TracingConfig = Field(default_factory=lambda: TracingConfig())
    front: Literal["grpcio", "native"] = Field(
        "grpcio", description="what serves Lookup on the workers' gRPC port: grpcio, or native (pygrpc-native, the "
        "native extra: HTTP/2 and gRPC in Rust outside the GIL, Lookup calls handed to the worker in batches; every "
        "other method, StreamLookup included, passes to the worker's grpcio server behind it). native refuses what "
        "it cannot honour: server.tls, server.max_connection_age_s above 0, server.tracing.enabled, server.workers 0, "
        "and min_client_ping_interval_s, max_concurrent_requests or max_connection_age_grace_s when set")
    probe_port: int | None = Field(
        None, ge=0, le=65535, description="plaintext HTTP port answering only /healthz and /readyz, for probes that "
        "cannot speak (mutual) TLS; off when unset")

    @model_validator(mode="after")
    def _admin_token_alias(self) -> ServerConfig:
        """``admin_token_file`` is read; else ``HPS_ADMIN_TOKEN`` sets the admin token when the config and
        ``HPS_SERVER__ADMIN_TOKEN`` do not."""
        load_secret_files(self, "server", "admin_token")
        alias = os.environ.get("HPS_ADMIN_TOKEN")
        if self.admin_token is None and alias:
            self.admin_token = SecretStr(alias)
        return self

    @model_validator(mode="after")
    def _auth(self) -> ServerConfig:
        check_auth(self)
        return self

    @model_validator(mode="after")
    def _native_front(self) -> ServerConfig:
        """server.front native serves what pygrpc-native 0.5 can: every setting it cannot honour is refused, named."""
        if self.front != "native":
            return self
        cannot = [why for refused, why in (
            (self.tls is not None, "server.tls (it serves no TLS)"),
            (self.max_connection_age_s > 0, "server.max_connection_age_s above 0 (it closes no connection by age: "
                                            "set 0)"),
            (self.tracing.enabled, "server.tracing.enabled (its lookups pass no interceptor)"),
            (self.workers == 0, "server.workers 0 (it serves the worker processes' port)"),
        ) if refused]
        cannot += [f"server.{key} (it does not enforce it)" for key in
                   ("min_client_ping_interval_s", "max_concurrent_requests", "max_connection_age_grace_s")
                   if key in self.model_fields_set]
        if cannot:
            raise ValueError("server.front native cannot honour " + "; ".join(cannot) + ": use server.front grpcio")
        return self

    @model_validator(mode="after")
    def _local_needs_workers(self) -> ServerConfig:
        """Colocated reads map the node's shared store, which only a server with worker processes keeps."""
        if self.local.enabled and self.workers == 0:
            raise ValueError("server.local needs the shared store of a node: server.workers >= 1 (or unset)")
        return self

    def worker_processes(self) -> int:
        """gRPC worker processes: ``workers``, or the CPUs this process may use."""
        if self.workers is not None:
            return self.workers
        return usable_cpus()

    def grpc_threads(self) -> int:
        """gRPC handler threads per serving process: ``grpc_workers``, or 2 per worker process (each has its own
        GIL), or the CPUs when the owner serves gRPC itself (at least 2)."""
        if self.grpc_workers is not None:
            return self.grpc_workers
        if self.worker_processes() > 0:
            return 2
        return max(2, usable_cpus())

    def streams_per_caller(self) -> int:
        """Streams one caller may hold open: ``max_streams_per_caller``, else a quarter of ``max_streams``."""
        return self.max_streams_per_caller or max(1, self.max_streams // 4)

    def local_socket(self) -> Path | None:
        """The Unix domain socket the owner serves gRPC on: ``uds_path``, else ``<local.path>/grpc.sock`` when
        colocated reads are enabled, else none."""
        if self.uds_path is not None:
            return self.uds_path
        return self.local.path / "grpc.sock" if self.local.enabled else None


class UpdatesConfig(_Section):
    """Online updates from Kafka."""

    type: Literal["kafka", "disabled"] = Field("disabled", description="kafka: follow topic <topic_prefix>.<model>")
    brokers: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, comma-separated host:port")
    topic_prefix: str = Field("hps", description="update topics are <topic_prefix>.<model>")
    group: str | None = Field(None, description="consumer group (lag monitoring); default <topic_prefix>.<hostname>")
    stall_after_s: float = Field(
        30.0, gt=0, description="messages waiting and none applied for this long: the stream is stalled (WARNING "
        "log, hps_update_stalled, /readyz 503)"
    )
    max_lag_s: float = Field(
        60.0, ge=0.0, description="a ready replica whose oldest unapplied update is older than this leaves the "
        "Service (NOT_SERVING, /readyz 503) until it catches up; 0 = never")
    offset_gap_recheck_s: float = Field(
        0.5, ge=0.0, description="a partition whose next message is past the offset expected is read again until "
        "the gap closes or stays this long (a broker may acknowledge a record before a fetch can see it; tansu does); "
        "0 = no check")
    replication_factor: int = Field(
        3, ge=1, le=32, description="copies of each partition of the update, dead-letter and registration topics "
        "the server creates (capped at the brokers the cluster has, with a WARNING)")
    min_insync_replicas: int = Field(
        2, ge=1, le=32, description="min.insync.replicas of the topics the server creates (capped at "
        "replication_factor - 1): with acks=all, an acknowledged update is on this many brokers")
    log_check_interval_s: float = Field(
        5.0, gt=0, description="how often the consumer asks the broker where each log starts and which topic it "
        "is: a position below the start, or a topic deleted and created again, means updates were lost")
    kafka_config: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="extra librdkafka settings for every client, e.g. security.protocol, sasl.*, ssl.*",
    )
    sasl_username: str | None = Field(None, description="SASL user (sasl.username), e.g. from a Secret's env var")
    sasl_password: SecretStr | None = Field(
        None, description="SASL password (sasl.password): HPS_UPDATES__SASL_PASSWORD from a Secret, not the file")
    sasl_password_file: Path | None = Field(None, description="a file holding the SASL password")
    admin_key: SecretStr | None = Field(
        None, description="HMAC key of the admin-only messages (tombstone purges on the update topics, model "
        "registrations on the registration log): they are signed with it, and applied only with a good signature; "
        "unset, such messages are refused, and a registration is made on the replica asked only")
    admin_key_file: Path | None = Field(None, description="a file holding updates.admin_key")

    @model_validator(mode="after")
    def _sasl_into_client_config(self) -> UpdatesConfig:
        """SASL credentials given as their own keys (environment variables or files from a Secret) reach every
        client."""
        load_secret_files(self, "updates", "sasl_password", "admin_key")
        if self.admin_key is not None and len(self.admin_key.get_secret_value()) < 16:
            raise ValueError("updates.admin_key needs at least 16 characters (an HMAC key)")
        if self.sasl_username is not None:
            self.kafka_config["sasl.username"] = self.sasl_username
        if self.sasl_password is not None:
            self.kafka_config["sasl.password"] = self.sasl_password.get_secret_value()
        return self


#: Partitions of every update topic (cluster.partitions): its divisors are the shard counts a fleet can grow to
#: without a new topic (1, 2, 3, 4, 6, 8, 12, 24).
DEFAULT_PARTITIONS = 24


class ClusterConfig(_Section):
    """Sharding: this process serves shard ``shard`` of ``shards``; a key lives on shard ``partition(key) % shards``,
    where partition is Kafka's murmur2 partitioner over ``partitions`` (see protos/hps/v1/update.proto)."""

    shards: int = Field(1, ge=1, le=4096, description="S: shards the keys are split over (1: every process serves all)")
    shard: int = Field(0, ge=0, description="the shard this process serves, in [0, shards)")
    partitions: int = Field(
        DEFAULT_PARTITIONS, ge=1, le=100_000,
        description="P: partitions of every update topic (created so, checked where they exist); a multiple of shards",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        if self.partitions % self.shards:
            raise ValueError(f"cluster.partitions ({self.partitions}) must be a multiple of cluster.shards "
                             f"({self.shards}), so that every shard owns whole partitions")
        if self.shard >= self.shards:
            raise ValueError(f"cluster.shard ({self.shard}) must be below cluster.shards ({self.shards})")
        return self


class ConstantDefault(_Section):
    """Every missing key of the table answers a row of this one value."""

    constant: float = Field(description="the value of every element")


DefaultSpec = Literal["zeros", "hashed_random"] | ConstantDefault

#: The widest stored row a tier holds, in 4-byte words.
MAX_ROW_WORDS = 16384


class TableConfig(_Section):
    """One embedding table of a model."""

    name: str = Field(pattern=NAME_PATTERN, description="the table's name in lookups")
    dim: int = Field(ge=1, le=16384, description="floats per row")
    default: DefaultSpec = Field("zeros", description="the row of a key no tier holds: zeros, {constant: X} or "
                                 "hashed_random (a deterministic per-key random row)")
    storage: Storage = Field("fp32", description="rows as stored in every tier (int8: row-wise scale and bias)")
    admit_after_writes: int = Field(
        1, ge=1, le=65535, description="a new key is stored once it has been written this many times (1: at once); "
        "earlier writes are dropped. Counted in the owner's memory (8 MiB a table above 1), so a restart counts "
        "again; stored keys, deletes and imports always pass")
    ttl_s: int | None = Field(
        None, ge=1, le=10 * 365 * 86400, description="seconds a row lives after it was last written (null: for "
        "ever): an older row is answered with the default and source EXPIRED, and removed in the background. The "
        "write time is the update message's (produced_at_ns), else the server's clock at a put or import; each row "
        "stores it in one more word. Set it before the table holds rows")

    @model_validator(mode="after")
    def _stamp_fits(self) -> TableConfig:
        """A TTL table's stored row (its format's words and the write time's) must fit a tier's widest row."""
        if self.ttl_s is not None and row_words(self.storage, self.dim) + 1 > MAX_ROW_WORDS:
            raise ValueError(f"table {self.name}: ttl_s stores one more word per row, and {self.storage} rows of dim "
                             f"{self.dim} already take {row_words(self.storage, self.dim)} words of at most "
                             f"{MAX_ROW_WORDS}: store it as fp16, bf16 or int8, or narrow it")
        return self


class ModelConfig(_Section):
    """One served model: a name and its embedding tables."""

    name: str = Field(pattern=NAME_PATTERN, description="the model's name in lookups and its update topic")
    tables: list[TableConfig] = Field(min_length=1, description="its embedding tables")
    version: int = Field(0, ge=0, le=2**31 - 1, description="0: the model as configured; N >= 1: version N of it, "
                         "served beside it (POST /v1/models/{model}/versions), with tables of its own")
    keep_versions: int = Field(2, ge=1, le=1000, description="the newest unlabelled versions kept when a version is "
                               "added, the new one included; older unlabelled ones are dropped with their rows (a "
                               "labelled one never is)")

    @field_validator("tables")
    @classmethod
    def _unique_tables(cls, tables: list[TableConfig]) -> list[TableConfig]:
        names = [t.name for t in tables]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate table name(s): {', '.join(dupes)}")
        return tables

    def table(self, name: str) -> TableConfig | None:
        return next((t for t in self.tables if t.name == name), None)

    @property
    def served_name(self) -> str:
        """The name its tables are served and stored under: ``name``, or ``name#vN`` for version N."""
        return served_name(self.name, self.version)


class HPSConfig(BaseSettings):
    """The whole configuration of one hps-service process."""

    model_config = SettingsConfigDict(
        env_prefix="HPS_", env_nested_delimiter="__", extra="forbid", case_sensitive=False
    )

    server: ServerConfig = Field(default_factory=ServerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    volatile: VolatileConfig = Field(default_factory=HashMapVolatile)
    persistent: PersistentConfig = Field(default_factory=PersistentConfig)
    updates: UpdatesConfig = Field(default_factory=UpdatesConfig)
    models: list[ModelConfig] = Field(default_factory=list)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    repository: RepositoryConfig | None = Field(None, description="where new model versions are published for every "
                                                "replica to import (unset: versions come from the REST API only)")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Earlier sources win: the environment overrides the file (passed as init kwargs).
        return (env_settings, init_settings)

    @field_validator("models")
    @classmethod
    def _unique_models(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate model name(s): {', '.join(dupes)}")
        return models

    @model_validator(mode="after")
    def _updates_need_a_durable_store(self) -> HPSConfig:
        """Kafka updates commit their offsets once applied; with no persistent tier that would acknowledge updates
        held in memory only, which a restart loses while the committed offsets skip them. Refused."""
        if self.updates.type == "kafka" and self.persistent.type == "disabled":
            raise ValueError(
                "updates.type kafka needs persistent.type rocksdb: with persistent.type disabled, offsets would be "
                "committed for updates held in memory only, and a restart would lose them")
        return self

    @model_validator(mode="after")
    def _repository_needs_a_store(self) -> HPSConfig:
        """The repository's versions are imported into RocksDB."""
        if self.repository is not None and (self.persistent.type != "rocksdb" or self.persistent.read_only):
            raise ValueError("repository needs a writable persistent tier (persistent.type rocksdb, not read_only): "
                             "its versions are imported there")
        return self

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


class ConfigError(Exception):
    """The configuration is invalid; the message names the key and the reason."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        # a section that is one of several models (volatile) names the model as a step of its path: not a key
        key = ".".join(str(p) for p in e["loc"] if p not in VOLATILE_TYPES) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"config key '{key}': {msg}")
    return f"invalid configuration ({source}): " + "; ".join(lines)


def load_config(path: str | Path | None = None, **overrides: Any) -> HPSConfig:
    """Load the YAML file at ``path`` (if any), apply ``HPS_*`` environment overrides, validate.

    Raises ConfigError with a one-line message naming each bad key.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}".replace("\n", " ")) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, not {type(loaded).__name__}")
        data = loaded
    data.update(overrides)
    try:
        return HPSConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def valid_name(name: str) -> bool:
    """Model and table names: letters, digits, '_' and '-', at most 64 characters."""
    return bool(NAME_RE.match(name))
