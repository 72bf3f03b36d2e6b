"""One validated settings tree, from a TOML file and `SLUICE_*` environment variables.

Precedence: defaults < TOML file (`SLUICE_CONFIG`, or `--config`) < environment.
The tree is made of sections (`kafka`, `group`, `redis`, `progress`, `kv`, `engine`, `limits`,
`stream`, `health`, `worker`, `tenancy`, `ops`), each a frozen msgspec Struct passed whole to the stage
that uses it. Every setting also has one flat name, its section's prefix plus the field
(`kafka.bootstrap` is `kafka_bootstrap`, `engine.model` is `model`): the variable is
`SLUICE_` + the flat name in capitals, and a TOML file may use either `[kafka] bootstrap = ...`
or the flat `kafka_bootstrap = ...`.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from schemas import Limits
from worker.redis_seeds import split_url

Port = Annotated[int, Meta(ge=0, le=65535)]
Positive = Annotated[int, Meta(ge=1)]
NonNegative = Annotated[int, Meta(ge=0)]
Seconds = Annotated[float, Meta(gt=0)]
SecondsOrOff = Annotated[float, Meta(ge=0)]  # 0: the check is off
ENV_PREFIX = "SLUICE_"
ONEDNN_CACHE_DEFAULT = 64  # engine.onednn_cache_capacity; bench/engine_shapes.py


class SettingsError(ValueError):
    """Raised at start-up; the message names the offending setting."""


class _Section(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class KafkaSettings(_Section):
    bootstrap: Annotated[str, Meta(min_length=1)] = "127.0.0.1:19092"
    client_id: str = "sluice"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    # Mutual TLS: the client certificate and its key (PEM), and the key's password if it is encrypted.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = None
    # Idempotent producers: on for real Kafka; the embedded dev broker lacks InitProducerId.
    idempotence: bool = True
    # Upper bound on how long a fetch waits for data. Apache Kafka answers as soon as
    # data arrives; the embedded broker waits the full time, so keep it short.
    fetch_max_wait_ms: Positive = 50
    # How long the producer waits for the broker to acknowledge a send before it retries or fails.
    request_timeout_ms: Positive = 40000
    # Request and backfill source records of a transaction that was aborted, or is still open, are not
    # read (Kafka's read_committed); records of producers without transactions are read as written.
    isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed"
    # How often the request consumer refreshes its metadata: partitions added to a request topic are
    # read only from the refresh after (aiokafka's default is 5 minutes).
    metadata_max_age_ms: Positive = 30000

    def options(self) -> dict:
        """Connection options shared by consumers, producers and admin clients."""
        opts: dict = {"bootstrap_servers": self.bootstrap, "security_protocol": self.security_protocol}
        if self.sasl_mechanism:
            opts.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                        sasl_plain_password=self.sasl_password)
        if self.security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            opts["ssl_context"] = create_ssl_context(cafile=self.ssl_cafile, certfile=self.ssl_certfile,
                                                     keyfile=self.ssl_keyfile, password=self.ssl_password)
        return opts


# Kafka's documentation advises at most a third of the session timeout, and lower to shorten normal
# rebalances: a survivor's next heartbeat bounds how soon it learns that a worker has gone.
DEFAULT_HEARTBEAT_MS = 1000


class GroupSettings(_Section):
    id: Annotated[str, Meta(min_length=1)] = "sluice-workers"
    commit_interval_ms: Positive = 500
    # A member whose heartbeats stop this long is dropped from the group and its partitions move.
    session_timeout_ms: Annotated[int, Meta(ge=1000)] = 10000
    # How often a member tells the coordinator it is alive; a survivor learns of a rebalance at its
    # next heartbeat, so once a dead worker has left (its guard's LeaveGroup) its partitions wait up
    # to this long for the survivors to rejoin. 0: a third of the session timeout, at most 1 s.
    heartbeat_interval_ms: NonNegative = 0
    # A worker process that dies (SIGKILL, the OOM killer, a crash) is taken out of the group at once by
    # its guard process (worker/group_guard.py) instead of holding its partitions for the session timeout.
    leave_on_death: bool = True
    # ... and hands the requests it was running to a surviving worker through the group's handoff
    # stream in Redis, which continues them before the rebalance (worker/handoff.py). Needs leave_on_death.
    handoff: bool = False
    # A worker whose group has no live member joins it while its engine loads, so that the coordinator's
    # hold on a new group's join passes meanwhile; one whose group has members joins once loaded
    # (worker/early_join.py).
    join_early: bool = True

    def heartbeat_ms(self) -> int:
        return self.heartbeat_interval_ms or max(100, min(DEFAULT_HEARTBEAT_MS, self.session_timeout_ms // 3))


class RedisSettings(_Section):
    # Redis Cluster seed nodes: redis://host:port[,host:port...]
    url: Annotated[str, Meta(pattern=r"^rediss?://")] = "redis://127.0.0.1:17001"
    key_prefix: str = "sluice"
    ttl_s: Positive = 86400  # stored answers
    timeout_ms: Positive = 500
    # Records read while Redis is unavailable wait this long for it (a master failover) before they
    # run without their stored answer and progress, marked `unchecked` on their replies.
    lookup_wait_s: Annotated[float, Meta(ge=0)] = 10.0
    # A cluster whose maxmemory-policy evicts keys would drop stored answers, progress and claims under
    # memory pressure, and the guarantees with them: the worker refuses to start on one unless allowed.
    allow_eviction: bool = False
    # ACL user and password (or a file holding the password, e.g. a mounted Secret); they take
    # precedence over credentials in the URL, and are never logged.
    username: str | None = None
    password: str | None = None
    password_file: str | None = None
    # TLS (`rediss://` in the URL turns it on too): the CA that signed the nodes' certificates, and a
    # client certificate and key where the cluster asks for one (tls-auth-clients).
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # Answers, progress and KV pages sealed with AES-256-GCM (or SM4-GCM) under keys from this TOML
    # file (worker/sealing.py); None stores them in clear.
    encryption_keys_file: str | None = None


    def client_options(self) -> dict:
        """Credentials and TLS for a redis-py cluster client (sync or asyncio), beside the URL."""
        opts: dict = {}
        if self.username is not None:
            opts["username"] = self.username
        if self.password_file is not None:
            opts["password"] = Path(self.password_file).read_text().strip()
        elif self.password is not None:
            opts["password"] = self.password
        if self.client_url().startswith("rediss://"):
            opts.update(ssl_ca_certs=self.tls_ca_file, ssl_certfile=self.tls_cert_file, ssl_keyfile=self.tls_key_file)
        return opts

    def client_url(self) -> str:
        """The URL clients connect with: `rediss://` when TLS is on (the scheme is what turns it on in
        both redis-py clients)."""
        if self.tls and self.url.startswith("redis://"):
            return "rediss://" + self.url.removeprefix("redis://")
        return self.url


class ProgressSettings(_Section):
    # Progress checkpoints (tokens emitted, next seq) live as long as an unfinished request may wait
    ttl_s: Positive = 86400


class KvSettings(_Section):
    # KV pages in Redis Cluster: requests continue on another worker without recomputing their prefix
    pages: bool = True
    ttl_s: Positive = 3600
    # Pages are saved only for requests whose prompt + max_tokens reaches this many tokens: a shorter
    # one is cheap to recompute on resume, and saving every page costs throughput (bench/compare.py's
    # sluice+kv arm). 0 saves every request's pages. Pages saved earlier are still loaded either way.
    save_min_tokens: NonNegative = 0
    # At most this many MiB of pages per second are saved (0: no budget). Over it, a request's pages
    # wait in order while it runs; those still waiting when it finishes are dropped, never the engine
    # slowed (worker/save_budget.py). sluice_kv_save_failures_total{reason="over_budget"} counts them.
    save_budget_mib_s: Annotated[float, Meta(ge=0)] = 0.0
    # Seconds of unused budget the bucket keeps: after a quiet spell, up to this much is spent at once,
    # so an occasional long prompt has all its pages saved while the long-run rate stays at the budget.
    save_burst_s: Annotated[float, Meta(gt=0)] = 1.0


class EngineSettings(_Section):
    # `fake`: the deterministic stand-in of worker/fake_engine.py, for load and fault tests at scale
    engine_kind: Literal["vllm", "fake"] = "vllm"
    fake_token_ms: NonNegative = 0  # the fake engine's time per generated token
    model: str = ".sluice/models/smollm2-135m-instruct"
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    # auto: bfloat16 on CPUs with AVX512-BF16/AMX, float32 on other CPUs, the model's dtype on GPU/NPU
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: Positive = 2048
    max_num_seqs: Positive = 64
    cpu_kvcache_gib: Positive = 2
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.85
    enable_prefix_caching: bool = True
    # Sizing for accelerators; passed to vLLM as they are (`vllm serve --help` describes each).
    tensor_parallel_size: Positive = 1
    pipeline_parallel_size: Positive = 1
    quantization: Annotated[str, Meta(pattern=r"^[a-z0-9_-]+$")] | None = None  # awq, gptq, fp8, ... (vLLM's names)
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    max_num_batched_tokens: Positive | None = None  # None: vLLM's default for the device
    # How the model is compiled at start-up: `graph-cache` (the default) is torch.compile with vLLM's
    # per-graph compile cache, which a restart loads; `auto` is vLLM's own default, its AOT cache:
    # the slowest first start and the fastest restart (on CPU only with worker/vllm_plugin.py's mend);
    # `eager` skips compilation (fast start, slower steps). See bench/cold_start.py.
    compile_mode: Literal["auto", "graph-cache", "eager"] = "graph-cache"
    # How vLLM's engine-core process starts on CPU: `forkserver` forks it from a process that imported
    # vLLM while the worker configured it (worker/engine_fork.py), about 8 s sooner on 2 cores, and it
    # spawns its model runner as vLLM does; `inprocess` also starts that forkserver with the OpenMP
    # binding vLLM would give the runner, and the engine core runs the model itself, about 8 s
    # sooner again (it falls back to `forkserver`, logged, where the binding cannot be worked out
    # ahead); `spawn` is vLLM's own way, fresh interpreters. GPU and NPU engines start vLLM's way.
    engine_start: Literal["inprocess", "forkserver", "spawn"] = "inprocess"
    # CPU only: how many compiled matrix kernels (oneDNN primitives) the engine keeps, one per batch
    # shape met, each holding memory that grows with the step's tokens. oneDNN's own default, 1024 (an
    # empty variable keeps it), let an engine core grow by gigabytes as a worker met new shapes;
    # fewer costs a step a few percent where it meets a shape it evicted. bench/engine_shapes.py.
    onednn_cache_capacity: NonNegative | None = ONEDNN_CACHE_DEFAULT
    # Benchmarks only: every request generates its max_tokens, as vLLM's `ignore_eos`, so arms that are
    # compared do the same work. Never in production: answers would run past their end.
    ignore_eos: bool = False


class StreamSettings(_Section):
    # Token records: the first token goes out at once; later ones are coalesced into
    # one record per `chunk_tokens` tokens or `chunk_ms` since the last record, whichever first.
    chunk_tokens: Positive = 8
    chunk_ms: NonNegative = 50


class HealthSettings(_Section):
    # Failing closed: the worker stops itself (not ready, drain, exit 1) when requests wait and the
    # engine makes no progress this long, when an intake loop has not polled this long, when no
    # reply could be produced this long, or when no offset could be committed this long while some
    # waited to be. Shorter broker outages are retried with back-off.
    engine_stall_s: Seconds = 120.0
    # Requests in the engine, no progress and its processes using under 2% of a core this long: a frozen
    # engine core (stopped, deadlocked, stuck in a device call that sleeps), failed long before the
    # stall bound, which stays for an engine that computes and never outputs. 0: off.
    engine_frozen_s: SecondsOrOff = 15.0
    engine_health_interval_s: Seconds = 10.0
    intake_stall_s: Seconds = 300.0  # a rebalance can hold a poll that long (max.poll.interval.ms)
    reply_outage_s: Seconds = 120.0
    commit_outage_s: Seconds = 120.0
    # A group join (the first, at start, or a rejoin after a rebalance) not completed this long fails
    # the worker: outside its group it reads nothing, and a join the coordinator holds (a member that
    # never rejoins, a broker that never answers it) would otherwise hold the worker for ever.
    group_join_s: Seconds = 120.0
    # How often the worker asks the broker whether its own topics (the request topics it reads, the
    # reply, dead-letter and audit topics) still exist; two answers in a row saying one is gone fail it.
    topic_check_interval_s: Seconds = 10.0
    # No broker answering those asks for this long fails the worker, busy or idle: the Kafka client
    # retries an unreachable broker for ever, and an idle worker has no reply or commit to fail.
    broker_outage_s: Seconds = 120.0
    # A partition the worker would read now (assigned, not paused) whose fetches no broker has answered
    # for this long fails the worker, so that the group gives it to another: a broker that answers
    # metadata but not fetches (a partition's leader cut off from this worker) is retried for ever by
    # the Kafka client while every poll returns empty (worker/fetch_watch.py). 0: off.
    fetch_outage_s: SecondsOrOff = 120.0


class WorkerSettings(_Section):
    topics_file: str | None = None  # None: the bundled topics/default.toml
    # The latency classes this worker consumes (comma-separated): class-dedicated pools, e.g.
    # realtime-only workers on their own accelerators. Each pool should have its own group_id.
    classes: Annotated[str, Meta(pattern=r"^(realtime|standard|batch)(,(realtime|standard|batch))*$")] = \
        "realtime,standard,batch"
    # Score templates: `<name>.toml` files here add to (or override) the built-in ones.
    templates_dir: str | None = None
    # Lower classes stay at their contended cap this long after a higher class had work.
    contention_hold_ms: NonNegative = 5000
    # fixed: lower classes under contention keep their topic's `contended_in_engine`. slo: that
    # cap follows the higher classes' `slo_ms` (halved when an answer is late, grown while on time).
    # step: it follows the engine's measured step time, so the busy class's steps stay within
    # `step_stretch` times what its own tokens cost (worker/step_budget.py).
    admission: Literal["fixed", "slo", "step"] = "fixed"
    step_stretch: Annotated[float, Meta(gt=1.0, le=10.0)] = 1.2
    drain_grace_s: Annotated[float, Meta(ge=0)] = 30.0
    # The rest of a shutdown (final commit, client and engine stops) gets this long after the drain
    # grace; past it `sluice worker` exits 1 without finishing, so a hung step cannot keep up a
    # worker that has stopped serving.
    stop_margin_s: Annotated[float, Meta(gt=0)] = 30.0
    # Requests of revoked partitions may finish this long before they are aborted (the new owner
    # continues them from their progress). Kept short: every member waits for the slowest revoke.
    revoke_grace_s: Annotated[float, Meta(ge=0)] = 2.0
    # Largest record sluice produces (replies, dead letters); Apache Kafka's default limit is 1 MB.
    max_produce_bytes: Annotated[int, Meta(ge=4096)] = 1_000_000
    # Audit records (on the topics file's `audit` topic) carry prompt and output text only when this is on.
    audit_content: bool = False


class TenancySettings(_Section):
    # Who a request belongs to (worker/tenancy.py): `single` - every request is `tenant`'s; `topic` -
    # the tenant of the tenant-dedicated request topic it came from (shared topics: `tenant`);
    # `signed` - records carry a tenant header and an HMAC under that tenant's key.
    mode: Literal["single", "topic", "signed"] = "single"
    tenant: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")] = "default"
    tenants_file: str | None = None  # TOML: per-tenant signing keys, reply_to pattern, in-flight limit
    # Reply topics (full-match regex) a tenant without its own `reply_to` may name; "" allows only
    # the default reply topic.
    reply_to: str = ""


class OpsSettings(_Section):
    metrics_port: Port = 9464
    metrics_host: str = "0.0.0.0"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"
    # net new container objects between two young garbage collections (Python's own default is 700);
    # a worker reading ahead grows its heap by tens of objects per request (bench/RESULTS.md, overhead)
    gc_young_threshold: Annotated[int, Meta(ge=100)] = 10_000


class Settings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kafka: KafkaSettings = KafkaSettings()
    group: GroupSettings = GroupSettings()
    redis: RedisSettings = RedisSettings()
    progress: ProgressSettings = ProgressSettings()
    kv: KvSettings = KvSettings()
    engine: EngineSettings = EngineSettings()
    limits: Limits = Limits()
    stream: StreamSettings = StreamSettings()
    health: HealthSettings = HealthSettings()
    worker: WorkerSettings = WorkerSettings()
    tenancy: TenancySettings = TenancySettings()
    ops: OpsSettings = OpsSettings()

    def override(self, **flat) -> "Settings":
        """A copy with some settings changed, by flat name (`group_id=...`), validated like `load`."""
        data = msgspec.to_builtins(self)
        for name, value in flat.items():
            _put(data, name, value)
        return _convert(data, set())


# Each section's prefix in flat names; "" where the field name already says what it is.
PREFIXES = {"kafka": "kafka_", "group": "group_", "redis": "redis_", "progress": "progress_", "kv": "kv_",
            "engine": "", "limits": "", "stream": "stream_", "health": "", "worker": "", "tenancy": "tenancy_", "ops": ""}
# flat name -> (section, field)
FLAT = {f"{PREFIXES[section]}{field}": (section, field)
        for section, kind in zip(Settings.__struct_fields__, Settings.__annotations__.values())
        for field in globals()[kind].__struct_fields__}
# The Limits field `max_tokens` reads best in code; as a setting it is the *limit* on a request's max_tokens.
FLAT["max_tokens_limit"] = FLAT.pop("max_tokens")
assert len(FLAT) == sum(len(globals()[k].__struct_fields__) for k in Settings.__annotations__.values()), "flat names collide"


def _put(data: dict, flat: str, value) -> None:
    if flat not in FLAT:
        raise SettingsError(f"unknown setting {flat}")
    section, field = FLAT[flat]
    data.setdefault(section, {})[field] = value


def flat_name(section: str, field: str) -> str:
    return next(n for n, sf in FLAT.items() if sf == (section, field))


def _env_overrides(environ) -> dict[str, object]:
    out = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == "SLUICE_CONFIG":
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name in FLAT:  # other SLUICE_* variables belong to tools and tests
            out[name] = None if raw == "" else raw
    return out


def _name_setting(message: str, from_env: set[str]) -> str:
    """'... - at `$.kafka.bootstrap`' -> name both the setting and its variable."""
    match = re.search(r"at `\$\.(\w+)(?:\.(\w+))?`", message)
    if not match:
        return message
    section, field = match.groups()
    if field is None:
        return f"invalid setting {section}: {message.split(' - at ')[0]}"
    flat = flat_name(section, field)
    where = f"{ENV_PREFIX}{flat.upper()}" if flat in from_env else f"{section}.{field}"
    return f"invalid setting {where}: {message.split(' - at ')[0]}"


def _convert(data: dict, from_env: set[str]) -> Settings:
    try:
        settings = msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(_name_setting(str(exc), from_env)) from None
    try:
        split_url(settings.redis.url)
    except ValueError as exc:
        raise SettingsError(f"redis_url (SLUICE_REDIS_URL): {exc}") from None
    if settings.group.heartbeat_ms() >= settings.group.session_timeout_ms:
        raise SettingsError("heartbeat_interval_ms (SLUICE_GROUP_HEARTBEAT_INTERVAL_MS) must be below "
                            "session_timeout_ms (SLUICE_GROUP_SESSION_TIMEOUT_MS)")
    if not 0 < settings.limits.default_max_tokens <= settings.limits.max_tokens:
        raise SettingsError("default_max_tokens (SLUICE_DEFAULT_MAX_TOKENS) must be 1..max_tokens_limit")
    return settings


def load(config_path: str | os.PathLike | None = None, environ=None, **overrides) -> Settings:
    """Settings from defaults, the TOML file, the environment, then `overrides` (flat names)."""
    environ = os.environ if environ is None else environ
    data: dict = {}
    path = config_path or environ.get("SLUICE_CONFIG")
    if path:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise SettingsError(f"config file {path} not found (SLUICE_CONFIG / --config)") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
        for key, value in doc.items():
            if isinstance(value, dict) and key in PREFIXES:
                data.setdefault(key, {}).update(value)
            elif key in FLAT:
                _put(data, key, value)
            else:
                raise SettingsError(f"config file {path}: unknown setting `{key}`")
    env = _env_overrides(environ)
    for name, value in {**env, **overrides}.items():
        _put(data, name, value)
    return _convert(data, set(env))
