"""The wire contract as an AsyncAPI 3.0 document, generated from the structs in `schemas/` and the
topics file, so that the document other teams code against cannot drift from what workers speak.

Operations are written from the worker's side: it receives requests and sends replies and dead
letters; `sluice backfill` receives transaction events and sends one result per event.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import msgspec

from schemas import dlq, signing
from schemas.audit import AuditRecord
from schemas.events import BackfillResult, Transaction
from schemas.wire import DoneReply, ErrorReply, Request, TokenReply

REF = "#/components/schemas/{name}"
STRUCTS = (Request, TokenReply, DoneReply, ErrorReply, Transaction, BackfillResult, AuditRecord)



def struct_schemas() -> dict[str, dict]:
    """JSON Schemas of every struct on the wire, with references between them as AsyncAPI components."""
    _, components = msgspec.json.schema_components(STRUCTS, ref_template=REF)
    return components


def json_schemas() -> dict[str, dict]:
    """Standalone JSON Schema documents for producers and consumers in other languages."""
    return {
        "request.schema.json": msgspec.json.schema(Request),
        "reply.schema.json": msgspec.json.schema(TokenReply | DoneReply | ErrorReply),
        "transaction.schema.json": msgspec.json.schema(Transaction),
        "backfill-result.schema.json": msgspec.json.schema(BackfillResult),
        "audit.schema.json": msgspec.json.schema(AuditRecord),
        "dlq-headers.schema.json": {"$schema": "https://json-schema.org/draft/2020-12/schema",
                                    "title": "sluice dead-letter headers", **dlq.HEADERS_SCHEMA},
    }


def _package_version() -> str:
    try:
        return version("sluice-llm")
    except PackageNotFoundError:
        return "0.0.0"


def _ref(name: str) -> dict:
    return {"$ref": REF.format(name=name)}


# Request headers; the two signing headers are required where workers run `tenancy_mode signed`.
REQUEST_HEADERS = {"type": "object", "properties": {
    "content-type": {"type": "string", "enum": ["application/json", "application/msgpack"],
                     "description": "The value's encoding; JSON when absent"},
    signing.TENANT_HEADER: {"type": "string", "description": "tenancy_mode signed: the tenant the record is from"},
    signing.SIGNATURE_HEADER: {"type": "string", "pattern": "^[^:]+:[0-9a-f]{64}$",
                               "description": "tenancy_mode signed: `<key id>:<hex HMAC-SHA256>` over "
                               "'sluice-v1\\n' + tenant + '\\n' + record key + '\\n' + value, under "
                               "that tenant's key (schemas/signing.py); the record key must hold no newline "
                               "byte"}}}


def _message(name: str, title: str, summary: str, payload: dict, key: str, headers: dict | None = None) -> dict:
    msg = {"name": name, "title": title, "summary": summary, "contentType": "application/json", "payload": payload,
           "bindings": {"kafka": {"key": {"type": "string", "description": key}, "bindingVersion": "0.5.0"}}}
    if headers is not None:
        msg["headers"] = headers
    return msg


def _channel(address: str, description: str, messages: list[str], topic=None, parameters=None) -> dict:
    ch = {"address": address, "description": description,
          "messages": {m: {"$ref": f"#/components/messages/{m}"} for m in messages}}
    if topic is not None:
        ch["bindings"] = {"kafka": {"topic": topic.name, "partitions": topic.partitions,
                                    "replicas": topic.replication_factor, "bindingVersion": "0.5.0"}}
    if parameters:
        ch["parameters"] = parameters
    return ch


def _operation(action: str, channel: str, summary: str, messages: list[str]) -> dict:
    return {"action": action, "channel": {"$ref": f"#/channels/{channel}"}, "summary": summary,
            "messages": [{"$ref": f"#/channels/{channel}/messages/{m}"} for m in messages]}


REPLY_KEY = ("The request id; the partition is murmur2 of it, as Kafka's default partitioner picks, so all of "
             "a request's replies are on one partition")


def document(catalog, bootstrap: str = "localhost:9092") -> dict:
    """The AsyncAPI 3.0 document of `catalog`'s topics and every message sluice reads or writes."""
    messages = {
        "request": _message("request", "Inference request", "A generate or score request; unknown fields are "
                            "ignored. The reply goes to reply_to, or the default reply topic.", _ref("Request"),
                            "The request id (keeps a request's records on one partition)", headers=REQUEST_HEADERS),
        "token": _message("token", "Streamed tokens", "Tokens of a streaming request, in seq order per id.",
                          _ref("TokenReply"), REPLY_KEY),
        "done": _message("done", "Final answer", "The request's last record: text, finish reason, usage and, "
                         "for score requests, label probabilities.", _ref("DoneReply"), REPLY_KEY),
        "error": _message("error", "Error answer", "The request's last record when it cannot be served.",
                          _ref("ErrorReply"), REPLY_KEY),
        "deadLetter": _message("deadLetter", "Dead letter", "A record with no readable id: its original bytes.",
                               {"type": "string", "format": "binary",
                                "description": "The original record value, unchanged"},
                               "The original record key", headers=dlq.HEADERS_SCHEMA),
        "transaction": _message("transaction", "Transaction event", "A card transaction, the input of fraud "
                                "scoring and of backfills.", _ref("Transaction"), "Any (often the card or account)"),
        "backfillResult": _message("backfillResult", "Backfill result", "One per source event: its scores or "
                                   "the error that stopped it.", _ref("BackfillResult"), "The event id"),
        "audit": _message("audit", "Audit record", "One per finished request (duplicates and refusals "
                          "included), produced before the request's offset is committed.", _ref("AuditRecord"),
                          "The request id (none for a record without a readable id)"),
    }
    channels, operations = {}, {}
    for t in catalog.requests:
        cid = f"requests_{t.latency_class}"
        slo = f" End-to-end objective {t.slo_ms} ms." if t.slo_ms is not None else ""
        channels[cid] = _channel(t.name, f"Requests of the {t.latency_class} latency class (scheduling priority "
                                 f"{t.priority}, lower first).{slo}", ["request"], t)
        operations[f"receive_{t.latency_class}"] = _operation(
            "receive", cid, f"Workers consume {t.latency_class} requests", ["request"])
    reply = ["token", "done", "error"]
    channels["replies"] = _channel(catalog.replies.name, "Default reply topic: every request ends with exactly "
                                   "one done or error record for its id; token records precede it when streaming.",
                                   reply, catalog.replies)
    channels["replyTo"] = _channel("{replyTo}", "A reply topic a request names in reply_to.", reply,
                                   parameters={"replyTo": {"description": "The request's reply_to"}})
    channels["deadLetters"] = _channel(catalog.dlq.name, "Records that could not be answered because they carry "
                                       "no readable id.", ["deadLetter"], catalog.dlq)
    if catalog.audit is not None:
        channels["audit"] = _channel(catalog.audit.name, "The audit trail: who asked for what and what came of it "
                                     "(prompt and output text only with SLUICE_AUDIT_CONTENT).", ["audit"], catalog.audit)
        operations["sendAudit"] = _operation("send", "audit", "Workers record every finished request", ["audit"])
    channels["backfillSource"] = _channel("{source}", "The topic a backfill replays (transaction events).",
                                          ["transaction"], parameters={"source": {"description": "--source"}})
    channels["backfillResults"] = _channel("{out}", "Where a backfill writes one result per source event.",
                                           ["backfillResult"], parameters={"out": {"description": "--out"}})
    operations["sendReply"] = _operation("send", "replies", "Workers answer on the default reply topic", reply)
    operations["sendReplyTo"] = _operation("send", "replyTo", "Workers answer on a request's reply_to", reply)
    operations["sendDeadLetter"] = _operation("send", "deadLetters", "Workers park unreadable records",
                                              ["deadLetter"])
    operations["receiveBackfillSource"] = _operation("receive", "backfillSource", "sluice backfill reads events",
                                                     ["transaction"])
    operations["sendBackfillResult"] = _operation("send", "backfillResults", "sluice backfill writes results",
                                                  ["backfillResult"])
    return {
        "asyncapi": "3.0.0",
        "info": {"title": "sluice", "version": _package_version(),
                 "description": "LLM inference over Kafka: requests by latency class in, streamed tokens and final "
                                "answers out. Generated by `sluice schemas asyncapi` from schemas/ and the topics file."},
        "defaultContentType": "application/json",
        "servers": {"kafka": {"host": bootstrap, "protocol": "kafka",
                              "description": "The cluster's bootstrap servers (kafka.bootstrap)"}},
        "channels": channels,
        "operations": operations,
        "components": {"schemas": {**struct_schemas(), "DeadLetterHeaders": dlq.HEADERS_SCHEMA}, "messages": messages},
    }
