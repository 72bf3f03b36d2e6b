"""One validated settings object, from a TOML file and `SLUICE_*` environment variables.

Precedence: defaults < TOML file (`SLUICE_CONFIG`, or `--config`) < environment.
Every field `foo_bar` is set by the variable `SLUICE_FOO_BAR`.
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
ENV_PREFIX = "SLUICE_"


class SettingsError(ValueError):
    """Raised at start-up; the message names the offending setting."""


class Settings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Kafka
    kafka_bootstrap: Annotated[str, Meta(min_length=1)] = "127.0.0.1:19092"
    kafka_client_id: str = "sluice"
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: str | None = None
    kafka_ssl_cafile: str | None = None
    # Idempotent producers: on for real Kafka; the embedded dev broker lacks InitProducerId.
    kafka_idempotence: bool = True
    group_id: Annotated[str, Meta(min_length=1)] = "sluice-workers"
    topics_file: str | None = None  # None: the bundled topics/default.toml
    commit_interval_ms: Positive = 500
    # Upper bound on how long a fetch waits for data. Apache Kafka answers as soon as
    # data arrives; the embedded broker waits the full time, so keep it short.
    kafka_fetch_max_wait_ms: Positive = 50
    # Redis Cluster seed nodes: redis://host:port[,host:port...]
    redis_url: Annotated[str, Meta(pattern=r"^rediss?://")] = "redis://127.0.0.1:17001"
    redis_key_prefix: str = "sluice"
    redis_ttl_s: Positive = 86400
    redis_timeout_ms: Positive = 500
    # Engine
    model: str = ".sluice/models/smollm2-135m-instruct"
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    # auto: bfloat16 on CPUs with AVX512-BF16/AMX, float32 on other CPUs, the model's dtype on GPU/NPU
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: Positive = 2048
    # KV pages in Redis Cluster: requests continue on another worker without recomputing their prefix
    kv_pages: bool = True
    kv_ttl_s: Positive = 3600
    # Progress checkpoints (tokens emitted, next seq) live as long as an unfinished request may wait
    progress_ttl_s: Positive = 86400
    max_num_seqs: Positive = 64
    cpu_kvcache_gib: Positive = 2
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.85
    # Worker
    # Lower classes stay at their contended cap this long after a higher class had work.
    contention_hold_ms: Annotated[int, Meta(ge=0)] = 5000
    # Token records: the first token goes out at once; later ones are coalesced into
    # one record per `stream_chunk_tokens` tokens or `stream_chunk_ms`, whichever first.
    stream_chunk_tokens: Positive = 8
    stream_chunk_ms: Annotated[int, Meta(ge=0)] = 50
    drain_grace_s: Annotated[float, Meta(ge=0)] = 30.0
    # Failing closed: the worker stops itself (not ready, drain, exit 1) when requests wait and the
    # engine makes no progress this long, when an intake loop has not polled this long, or when no
    # reply could be produced this long. Shorter broker outages are retried with back-off.
    engine_stall_s: Annotated[float, Meta(gt=0)] = 120.0
    engine_health_interval_s: Annotated[float, Meta(gt=0)] = 10.0
    intake_stall_s: Annotated[float, Meta(gt=0)] = 60.0
    reply_outage_s: Annotated[float, Meta(gt=0)] = 120.0
    # Largest record sluice produces (replies, dead letters); Apache Kafka's default limit is 1 MB.
    max_produce_bytes: Annotated[int, Meta(ge=4096)] = 1_000_000
    metrics_port: Port = 9464
    metrics_host: str = "0.0.0.0"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"
    # Request limits
    max_record_bytes: Positive = 1 << 20
    max_tokens_limit: Positive = 1024
    default_max_tokens: Positive = 64
    max_stop: Annotated[int, Meta(ge=0)] = 4
    max_stop_chars: Positive = 64
    max_messages: Positive = 64
    max_prompt_chars: Positive = 256 * 1024
    max_prompt_tokens: Positive | None = None
    max_nesting_depth: Positive = 32
    # Score templates: `<name>.toml` files here add to (or override) the built-in ones.
    templates_dir: str | None = None

    def limits(self) -> Limits:
        return Limits(
            max_record_bytes=self.max_record_bytes,
            max_tokens=self.max_tokens_limit,
            default_max_tokens=self.default_max_tokens,
            max_stop=self.max_stop,
            max_stop_chars=self.max_stop_chars,
            max_messages=self.max_messages,
            max_prompt_chars=self.max_prompt_chars,
            max_prompt_tokens=self.max_prompt_tokens,
            max_nesting_depth=self.max_nesting_depth,
        )

    def kafka_common(self) -> dict:
        """Connection options shared by consumers, producers and admin clients."""
        opts: dict = {"bootstrap_servers": self.kafka_bootstrap, "security_protocol": self.kafka_security_protocol}
        if self.kafka_sasl_mechanism:
            opts.update(
                sasl_mechanism=self.kafka_sasl_mechanism,
                sasl_plain_username=self.kafka_sasl_username,
                sasl_plain_password=self.kafka_sasl_password,
            )
        if self.kafka_security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            opts["ssl_context"] = create_ssl_context(cafile=self.kafka_ssl_cafile)
        return opts


FIELDS = {name: name for name in Settings.__struct_fields__}


def _env_overrides(environ) -> dict:
    out = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == "SLUICE_CONFIG":
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in FIELDS:
            continue  # other SLUICE_* variables belong to tools and tests
        out[name] = None if raw == "" else raw
    return out


def _name_setting(message: str, from_env: set[str]) -> str:
    """'... - at `$.metrics_port`' -> name both the field and its variable."""
    match = re.search(r"at `\$\.(\w+)`", message)
    if not match:
        return message
    field = match.group(1)
    where = f"{ENV_PREFIX}{field.upper()}" if field in from_env else field
    return f"invalid setting {where}: {message.split(' - at ')[0]}"


def load(config_path: str | os.PathLike | None = None, environ=None, **overrides) -> Settings:
    environ = os.environ if environ is None else environ
    data: dict = {}
    path = config_path or environ.get("SLUICE_CONFIG")
    if path:
        try:
            data.update(tomllib.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise SettingsError(f"config file {path} not found (SLUICE_CONFIG / --config)") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    env = _env_overrides(environ)
    data.update(env)
    data.update(overrides)
    try:
        settings = msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(_name_setting(str(exc), set(env))) from None
    try:
        split_url(settings.redis_url)
    except ValueError as exc:
        raise SettingsError(f"redis_url (SLUICE_REDIS_URL): {exc}") from None
    return settings
