"""The wire contract for other teams: the AsyncAPI 3.0 document passes the AsyncAPI project's own
parser, covers every topic and message, and its schemas accept what sluice really writes."""

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import msgspec

import topics
from schemas import dlq
from schemas.asyncapi import document, json_schemas
from schemas.wire import DoneReply, ErrorCode, ErrorReply, TokenReply, Usage
from tests.tools import missing, need_tool
from tests.unit.test_templates import EVENT

ROOT = Path(__file__).resolve().parents[2]
PARSER_HOME = ROOT / ".sluice" / "node"  # .ci/run: npm install --prefix .sluice/node @asyncapi/parser


def parse(doc: dict, tmp_path) -> subprocess.CompletedProcess:
    node = need_tool("node", "nodejs")
    if not (PARSER_HOME / "node_modules" / "@asyncapi" / "parser").is_dir():
        missing("asyncapi-parser", f"@asyncapi/parser is not installed under {PARSER_HOME} (see .ci/run)")
    path = tmp_path / "asyncapi.json"
    path.write_text(json.dumps(doc))
    return subprocess.run([node, str(ROOT / "tests" / "asyncapi_validate.cjs"), str(path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "NODE_PATH": str(PARSER_HOME / "node_modules")})


def test_the_document_passes_the_asyncapi_parser(tmp_path):
    catalog = topics.load()
    out = parse(document(catalog), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["version"] == "3.0.0"
    # 3 request classes, default replies, reply_to, DLQ, backfill source and results, the audit trail
    assert catalog.audit is not None
    assert summary["channels"] == len(catalog.requests) + 6
    assert summary["messages"] == 8


def test_the_parser_rejects_a_broken_document(tmp_path):
    doc = document(topics.load())
    doc["operations"]["sendReply"]["channel"] = {"$ref": "#/channels/nowhere"}
    assert parse(doc, tmp_path).returncode != 0


def test_every_topic_of_the_topics_file_is_a_channel_with_its_kafka_binding():
    catalog = topics.load()
    doc = document(catalog)
    addresses = {ch["address"]: ch for ch in doc["channels"].values()}
    for t in catalog.topic:
        assert addresses[t.name]["bindings"]["kafka"]["partitions"] == t.partitions


def schema_of(name: str) -> jsonschema.Validator:
    schema = json_schemas()[name]
    return jsonschema.Draft202012Validator(schema)


def test_the_exported_schemas_accept_what_sluice_writes_and_reject_what_it_refuses():
    request = schema_of("request.schema.json")
    request.validate({"id": "r1", "prompt": "hi", "max_tokens": 4, "future_field": 1})  # unknown fields ignored
    request.validate({"id": "s1", "kind": "score", "template": "fraud", "event": EVENT})
    assert not request.is_valid({"id": "", "prompt": "hi"})
    assert not request.is_valid({"id": "r1", "temperature": 9})

    reply = schema_of("reply.schema.json")
    for r in (TokenReply("r1", 0, "Hi", [42]), DoneReply("r1", 1, "Hi", "stop", Usage(3, 1), scores={"fraud": 0.2}),
              ErrorReply("r1", ErrorCode.DEADLINE_EXCEEDED, "late")):
        reply.validate(json.loads(msgspec.json.encode(r)))
    assert not reply.is_valid({"type": "done", "id": "r1"})

    schema_of("transaction.schema.json").validate(EVENT)
    headers = {k: v.decode() for k, v in dlq.headers("invalid_request", "not JSON", "sluice.requests.batch", 3, 17)}
    schema_of("dlq-headers.schema.json").validate(headers)
    assert not schema_of("dlq-headers.schema.json").is_valid({**headers, dlq.ERROR_CODE: "nope"})


def test_sluice_schemas_writes_both_forms(tmp_path):
    sluice = ROOT / ".venv" / "bin" / "sluice"
    out = subprocess.run([sluice, "schemas", "export", str(tmp_path / "json")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "json").iterdir()) == sorted(json_schemas())
    out = subprocess.run([sluice, "schemas", "asyncapi", "--out", str(tmp_path / "asyncapi.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "asyncapi.json").read_text())["asyncapi"] == "3.0.0"


def test_the_committed_document_is_the_generated_one():
    committed = json.loads((ROOT / "schemas" / "asyncapi.json").read_text())
    host = committed["servers"]["kafka"]["host"]  # the deployment's own bootstrap, whatever it is
    assert committed == document(topics.load(), host), "run: sluice schemas asyncapi --out schemas/asyncapi.json"
