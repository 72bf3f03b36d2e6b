"""Start-up checks that run before the engine loads: a setting that cannot work stops the worker at
once with a message naming it, instead of a worker that looks healthy and serves nothing.

- the tenancy settings and tenants file, and the encryption keys file, must load;
- Redis must accept the credentials and allow the commands sluice runs. Redis that cannot be reached
  is not fatal (the worker serves degraded, as after a later outage); Redis that refuses the
  credentials is, since waiting will not fix it;
- the Kafka bootstrap must accept the TLS and SASL settings;
- a model named by a local path must be a model directory there (a Hugging Face repository id is
  left to vLLM).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from worker import sealing, topic_metadata
from worker.tenancy import Tenancy, TenancyError


class StartupError(RuntimeError):
    """A setting that cannot work; the message names it (and never a secret)."""


_REDIS_AUTH = ("SLUICE_REDIS_USERNAME / SLUICE_REDIS_PASSWORD / SLUICE_REDIS_PASSWORD_FILE "
               "(or the credentials in SLUICE_REDIS_URL)")


def _chain(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def check_files(settings, default_reply_topic: str) -> None:
    try:
        Tenancy.from_settings(settings.tenancy, default_reply_topic)
    except TenancyError as exc:
        raise StartupError(f"tenancy (SLUICE_TENANCY_*): {exc}") from None
    try:
        sealing.load(settings.redis.encryption_keys_file)
    except sealing.KeyFileError as exc:
        raise StartupError(f"SLUICE_REDIS_ENCRYPTION_KEYS_FILE: {exc}") from None
    if settings.redis.password_file is not None:
        try:
            open(settings.redis.password_file).close()
        except OSError as exc:
            raise StartupError(f"SLUICE_REDIS_PASSWORD_FILE: cannot read {settings.redis.password_file} "
                               f"({exc.strerror})") from None


async def check_redis(redis_settings, timeout_s: float = 5.0) -> str:
    """'ok', or 'unreachable' (served degraded); `StartupError` when Redis refuses the credentials,
    the TLS settings, or the commands sluice needs."""
    from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

    from worker.redis_client import cluster_client

    tls = redis_settings.client_url().startswith("rediss://")
    client = None
    try:
        client = cluster_client(redis_settings, timeout_s)
        async with asyncio.timeout(timeout_s * 2):
            await client.initialize()
            probe = f"{redis_settings.key_prefix}:preflight:{{{uuid.uuid4().hex}}}"
            await client.set(probe, b"1", ex=10)
            await client.eval("return redis.call('DEL', KEYS[1])", 1, probe)
            policies = await eviction_policies(client)
    except Exception as exc:  # noqa: BLE001 - classified below
        for cause in _chain(exc):
            text = str(cause)
            if isinstance(cause, AuthenticationError) or "WRONGPASS" in text or "NOAUTH" in text \
                    or "invalid username-password" in text:
                raise StartupError(f"Redis refused the credentials: check {_REDIS_AUTH}") from None
            if isinstance(cause, NoPermissionError) or "NOPERM" in text:
                raise StartupError(f"the Redis user lacks a permission sluice needs ({text.split(':')[0][:120]}): "
                                   f"it must be allowed SET, GET, DEL, EXPIRE, HSET, HGETALL, EXISTS, EVAL on "
                                   f"keys `{redis_settings.key_prefix}:*` ({_REDIS_AUTH})") from None
            lowered = text.lower()
            if tls and (isinstance(cause, ConnectionResetError) or "certificate required" in lowered
                        or "certificate_required" in lowered):
                # a TLS server that wants a client certificate sends a `certificate required` alert and
                # resets the connection after the handshake: the client sees whichever it reads first
                raise StartupError("Redis refused the TLS connection (a client certificate may be required): check "
                                   "SLUICE_REDIS_TLS_CERT_FILE, SLUICE_REDIS_TLS_KEY_FILE, SLUICE_REDIS_TLS_CA_FILE")
            if "SSL" in type(cause).__name__ or "certificate" in lowered or "ssl" in lowered:
                raise StartupError(f"TLS to Redis failed ({type(cause).__name__}): check SLUICE_REDIS_TLS, "
                                   "SLUICE_REDIS_TLS_CA_FILE, SLUICE_REDIS_TLS_CERT_FILE, SLUICE_REDIS_TLS_KEY_FILE")
            if isinstance(cause, ResponseError):
                raise StartupError(f"Redis answered an error at start-up: {text[:200]}") from None
        return "unreachable"
    finally:
        if client is not None:
            try:
                await client.aclose()
            except Exception:  # noqa: BLE001 - closing a client that never connected
                pass
    evicting = sorted({policy for policy in policies.values() if policy != "noeviction"})
    if evicting and not redis_settings.allow_eviction:
        raise StartupError(f"Redis Cluster evicts keys under memory pressure (maxmemory-policy "
                           f"{', '.join(evicting)}): sluice's stored answers, progress and claims would be dropped "
                           f"with them, and the repeated-id, resume and fencing guarantees too. Set "
                           f"maxmemory-policy noeviction on every primary (then a full Redis refuses writes and "
                           f"the worker serves degraded, saying so), or SLUICE_REDIS_ALLOW_EVICTION=true to "
                           f"accept it")
    return "ok"


async def eviction_policies(client) -> dict[str, str]:
    """Each primary's maxmemory-policy; empty where CONFIG GET is not allowed (managed services often
    refuse it), so the check is skipped rather than the worker stopped."""
    from redis.exceptions import NoPermissionError, ResponseError

    try:
        replies = await client.config_get("maxmemory-policy", target_nodes=client.PRIMARIES)
    except (NoPermissionError, ResponseError):
        return {}
    if isinstance(replies, dict) and "maxmemory-policy" in replies:  # a single node answered
        replies = {"": replies}
    return {str(node): (reply or {}).get("maxmemory-policy", "noeviction") for node, reply in replies.items()}


async def check_kafka(kafka_settings, topics=(), timeout_s: float = 15.0) -> None:
    """The bootstrap must accept a connection with these TLS and SASL settings, and `topics` must exist.

    A worker never creates its topics: where the broker creates topics on first use, it would have
    made them with the broker's partition count; where it does not, the worker would have read
    nothing and answered no one until its reply outage bound ended it."""
    from aiokafka.admin import AIOKafkaAdminClient

    try:
        opts = kafka_settings.options()
    except OSError as exc:  # a certificate, key or CA file that cannot be read
        raise StartupError(f"SLUICE_KAFKA_SSL_*: {exc.filename or ''} {exc.strerror or exc}".strip()) from None
    admin = AIOKafkaAdminClient(**opts, request_timeout_ms=int(timeout_s * 1000))
    try:
        try:
            async with asyncio.timeout(timeout_s):
                await admin.start()
                wrong = topic_metadata.problems(await admin._send_request(topic_metadata.request(topics))) \
                    if topics else {}
        except Exception as exc:  # noqa: BLE001 - any failure here names the settings
            what = next((c for c in _chain(exc) if "SSL" in type(c).__name__ or "Sasl" in type(c).__name__
                         or "Authentication" in type(c).__name__), exc)
            # a bare timeout says nothing by its name: a broker that is down or stopped, or a listener
            # that speaks another protocol, leaves the client waiting
            why = (f"no answer within {timeout_s:g} s" if what is exc and isinstance(exc, TimeoutError)
                   else f"{type(what).__name__}: {str(what)[:160]}")
            raise StartupError(f"cannot connect to Kafka at SLUICE_KAFKA_BOOTSTRAP={kafka_settings.bootstrap} with "
                               f"SLUICE_KAFKA_SECURITY_PROTOCOL={kafka_settings.security_protocol} ({why}): is the "
                               "broker up there, and do the SLUICE_KAFKA_SSL_* and SLUICE_KAFKA_SASL_* settings "
                               "match its listener?") from None
        missing = [t for t in topics if wrong.get(t) == topic_metadata.PROBLEMS[3]]
        if missing:
            raise StartupError(f"topics missing on the broker: {', '.join(missing)}; create them with "
                               f"`sluice topics apply` (or deploy/'s KafkaTopic resources) before starting workers")
        if wrong:
            raise StartupError("topics the workers cannot use: " + "; ".join(f"{t} {why}" for t, why in wrong.items()))
    finally:
        try:
            await admin.close()
        except Exception:  # noqa: BLE001
            pass


def check_model(model: str) -> None:
    """For a local path that is not there, vLLM's start-up ends in "Repo id must be in the form
    'repo_name' or 'namespace/repo_name'", which names neither the setting nor the fix."""
    path = Path(model).expanduser()
    local = model.startswith(("/", ".", "~")) or model.count("/") > 1 or path.exists()
    if not local:
        return  # `namespace/name`: a repository id
    if path.is_file() and path.suffix == ".gguf":
        return  # vLLM loads a single GGUF file too
    if not path.exists():
        raise StartupError(f"SLUICE_MODEL={model}: no such directory (`sluice model prepare` writes the bundled "
                           f"model to .sluice/models/smollm2-135m-instruct)")
    if not path.is_dir():
        raise StartupError(f"SLUICE_MODEL={model}: not a model directory (a file, and not a .gguf one)")
    if not (path / "config.json").is_file():
        raise StartupError(f"SLUICE_MODEL={model}: not a model directory (no config.json in it)")


async def check(settings, catalog) -> dict:
    check_files(settings, catalog.replies.name)
    if settings.engine.engine_kind == "vllm":
        check_model(settings.engine.model)
    await check_kafka(settings.kafka, [t.name for t in catalog.serving(settings.worker.classes.split(",")).topic])
    return {"redis": await check_redis(settings.redis)}
