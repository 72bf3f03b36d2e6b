"""Tenancy over the in-memory doubles: signed records, ids scoped by tenant, reply_to allow-list, quotas."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest

from schemas import DoneReply, ErrorCode, ErrorReply, Request, dlq
from schemas.signing import SIGNATURE_HEADER, TENANT_HEADER, Unsignable, signed_headers
from tests.unit.harness import CATALOG, REPLIES, J, Memory, running, until
from worker.fake_engine import FakeEngine
from worker.tenancy import Tenancy, TenancyError, TenantPolicy, Unauthenticated

SECRET_A, SECRET_B = b"a" * 32, b"b" * 32
TENANTS = f"""
[tenant.acme]
signing_keys = {{ k1 = "{base64.b64encode(SECRET_A).decode()}" }}
reply_to = "acme\\\\.replies"
max_in_flight = 2
retry_after_ms = 750

[tenant.globex]
signing_keys = {{ k1 = "{base64.b64encode(SECRET_B).decode()}" }}
"""


def record(value: bytes, key: bytes | None, headers=()):
    return SimpleNamespace(value=value, key=key, headers=list(headers))


def signed(tenant: str, secret: bytes, body: dict, key_id: str = "k1"):
    value, key = J(body), body["id"].encode()
    return value, key, signed_headers(tenant, key_id, secret, key, value)


@pytest.fixture()
def tenants_file(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    return str(path)


def tenancy(tenants_file, mode="signed"):
    settings = SimpleNamespace(mode=mode, tenant="default", tenants_file=tenants_file, reply_to="")
    return Tenancy.from_settings(settings, "sluice.replies")


GOOD = {"id": "r1", "prompt": "hello"}
CASES = [
    # (what, headers changed by, value changed by, expected tenant or error fragment)
    ("valid", None, None, "acme"),
    ("no headers", lambda h: [], None, "headers are required"),
    ("unknown tenant", lambda h: [(TENANT_HEADER, b"initech"), h[1]], None, "unknown tenant"),
    ("another tenant's name", lambda h: [(TENANT_HEADER, b"globex"), h[1]], None, "does not verify"),
    ("unknown key id", lambda h: [h[0], (SIGNATURE_HEADER, b"k9:" + h[1][1].split(b":")[1])], None, "no signing key"),
    ("altered value", None, lambda v: v.replace(b"hello", b"hellO"), "does not verify"),
    ("garbage signature", lambda h: [h[0], (SIGNATURE_HEADER, b"k1:zz")], None, "does not verify"),
]


@pytest.mark.parametrize("what,edit_headers,edit_value,expected", CASES, ids=[c[0] for c in CASES])
def test_signed_records_verify_only_unaltered_under_the_tenants_key(tenants_file, what, edit_headers, edit_value,
                                                                      expected):
    t = tenancy(tenants_file)
    value, key, headers = signed("acme", SECRET_A, GOOD)
    headers = edit_headers(headers) if edit_headers else headers
    value = edit_value(value) if edit_value else value
    rec = record(value, key, headers)
    if expected == "acme":
        assert t.tenant_of(rec, Request(id="r1", prompt="hello")) == "acme"
    else:
        with pytest.raises(Unauthenticated, match=expected):
            t.tenant_of(rec, Request(id="r1", prompt="hello"))


def test_a_record_key_swapped_or_a_tenant_field_naming_another_tenant_is_refused(tenants_file):
    t = tenancy(tenants_file)
    value, key, headers = signed("acme", SECRET_A, GOOD)
    with pytest.raises(Unauthenticated, match="does not verify"):
        t.tenant_of(record(value, b"other-key", headers), Request(id="r1"))
    body = {**GOOD, "tenant": "globex"}
    value, key, headers = signed("acme", SECRET_A, body)
    with pytest.raises(Unauthenticated, match="not its signed tenant"):
        t.tenant_of(record(value, key, headers), Request(id="r1", tenant="globex"))


def test_a_signature_cannot_be_moved_to_a_record_whose_key_ends_further_on(tenants_file):
    """The signed bytes join key and value with a newline: a key holding one could take the signature of
    another record (here, one whose value is not a request) for a record that is a valid request."""
    t = tenancy(tenants_file)
    inner = J({"id": "r1", "prompt": "run me"})
    value = b"note\n" + inner  # what the producer signed, with key b"r1"
    headers = signed_headers("acme", "k1", SECRET_A, b"r1", value)
    assert t.tenant_of(record(value, b"r1", headers), Request(id="r1")) == "acme"
    forged = record(inner, b"r1\nnote", headers)  # the same bytes, the key ending at the next newline
    with pytest.raises(Unauthenticated, match="newline"):
        t.tenant_of(forged, Request(id="r1", prompt="run me"))
    with pytest.raises(Unsignable, match="newline"):
        signed_headers("acme", "k1", SECRET_A, b"r1\nnote", inner)


def test_single_mode_ignores_the_tenant_field_and_reply_to_follows_the_allow_list(tenants_file):
    single = tenancy(tenants_file, mode="single")
    assert single.tenant_of(record(b"{}", None), Request(id="x", tenant="globex")) == "default"
    t = tenancy(tenants_file)
    assert t.reply_to_refused("acme", None) is None
    assert t.reply_to_refused("acme", "sluice.replies") is None  # the default reply topic
    assert t.reply_to_refused("acme", "acme.replies") is None
    assert "not allowed" in t.reply_to_refused("acme", "acme.replies.x")  # a full match, not a prefix
    assert "not allowed" in t.reply_to_refused("globex", "acme.replies")  # another tenant's pattern
    assert "not allowed" in t.reply_to_refused("acme", CATALOG.request_topic("realtime").name)


def test_tenancy_settings_that_cannot_work_stop_start_up(tmp_path):
    with pytest.raises(TenancyError, match="needs signing_keys"):
        Tenancy("signed", "default", {}, "sluice.replies")
    with pytest.raises(TenancyError, match="not a regular expression"):
        Tenancy("single", "default", {"x": TenantPolicy(reply_to="(")}, "sluice.replies")
    with pytest.raises(TenancyError, match="not base64"):
        Tenancy("signed", "default", {"x": TenantPolicy(signing_keys={"k": "***"})}, "sluice.replies")
    with pytest.raises(TenancyError, match="not found"):
        Tenancy.from_settings(SimpleNamespace(mode="single", tenant="d", tenants_file=str(tmp_path / "no"),
                                              reply_to=""), "r")


def _final(mem, rid):
    return [r for r in mem.finals(everywhere=True).get(rid, [])]


async def test_signed_worker_scopes_ids_by_tenant_and_dead_letters_what_it_cannot_authenticate(tenants_file):
    mem = Memory(partitions=1, tenancy_mode="signed", tenancy_tenants_file=tenants_file)
    mem.send("standard", *signed("acme", SECRET_A, {"id": "same", "prompt": "acme's prompt", "max_tokens": 3}))
    mem.send("standard", *signed("globex", SECRET_B, {"id": "same", "prompt": "globex's prompt, longer",
                                                      "max_tokens": 5}))
    forged = {"id": "same", "prompt": "x", "reply_to": "acme.replies"}
    mem.send("standard", J(forged), b"same", [(TENANT_HEADER, b"acme"), (SIGNATURE_HEADER, b"k1:" + b"0" * 64)])
    mem.send("standard", J({"id": "plain", "prompt": "x"}), b"plain")  # unsigned
    async with running(mem):
        assert await until(mem.all_committed)
        # both tenants' "same" ran: two different answers, one per tenant
        done = [r for r in _final(mem, "same") if isinstance(r, DoneReply)]
        assert len(done) == 2 and {d.usage.completion_tokens for d in done} == {3, 5}
        assert set(mem.answers.answers) >= {"acme:same", "globex:same"}
        # globex repeats the id: it gets its own stored answer back, never acme's
        mem.send("standard", *signed("globex", SECRET_B, {"id": "same", "prompt": "anything", "max_tokens": 9}))
        assert await until(mem.all_committed)
        done = [r for r in _final(mem, "same") if isinstance(r, DoneReply)]
        assert len(done) == 3 and done[-1].usage.completion_tokens == 5
    assert _final(mem, "plain") == [], "an unauthenticated record is never answered"
    assert len(mem.dead_letters()) == 2  # the forged one and the unsigned one
    assert all(dlq.parse(r.headers)[dlq.ERROR_MESSAGE].startswith("unauthenticated") for r in mem.dead_letters())
    assert "acme.replies" not in {tp.topic for tp in mem.broker.logs}


async def test_reply_to_outside_the_allow_list_is_refused_on_the_default_topic(tenants_file):
    mem = Memory(partitions=1, tenancy_mode="signed", tenancy_tenants_file=tenants_file)
    mem.send("standard", *signed("globex", SECRET_B, {"id": "g1", "prompt": "x", "reply_to": "acme.replies"}))
    mem.send("standard", *signed("acme", SECRET_A, {"id": "a1", "prompt": "x", "max_tokens": 2,
                                                    "reply_to": "acme.replies"}))
    async with running(mem):
        assert await until(mem.all_committed)
    [refused] = mem.finals()["g1"]
    assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.INVALID_REQUEST
    assert "not allowed" in refused.message
    assert isinstance(mem.finals(everywhere=True)["a1"][0], DoneReply)
    assert "a1" not in mem.finals()  # answered on acme.replies, not on the default topic
    assert "g1" not in {r.id for r in mem.replies(everywhere=True) if r not in mem.replies()}


async def test_a_tenant_over_its_in_flight_limit_is_answered_overloaded_while_another_is_served(tenants_file):
    mem = Memory(partitions=1, engine=FakeEngine(token_delay_s=0.05), tenancy_mode="signed",
                 tenancy_tenants_file=tenants_file)
    for i in range(6):
        mem.send("standard", *signed("acme", SECRET_A, {"id": f"a{i}", "prompt": "x", "max_tokens": 20,
                                                        "reply_to": "acme.replies"}))
    for i in range(3):
        mem.send("standard", *signed("globex", SECRET_B, {"id": f"g{i}", "prompt": "x", "max_tokens": 20}))
    async with running(mem):
        assert await until(mem.all_committed, timeout=30)
    finals = mem.finals(everywhere=True)
    acme = [finals[f"a{i}"][0] for i in range(6)]
    over = [r for r in acme if isinstance(r, ErrorReply)]
    assert over and all(r.code == ErrorCode.OVERLOADED and r.retry_after_ms == 750 for r in over)
    assert sum(isinstance(r, DoneReply) for r in acme) >= 2  # its limit's worth ran
    assert all(isinstance(finals[f"g{i}"][0], DoneReply) for i in range(3)), "the other tenant is served"
    for r in over:  # not stored: publishing the id again runs it
        assert f"acme:{r.id}" not in mem.answers.answers


async def test_every_finished_request_has_one_audit_record_without_its_text_by_default(tenants_file):
    mem = Memory(partitions=1, tenancy_mode="signed", tenancy_tenants_file=tenants_file)
    mem.send("standard", *signed("acme", SECRET_A, {"id": "au1", "prompt": "secret prompt", "max_tokens": 3}))
    mem.send("standard", *signed("acme", SECRET_A, {"id": "au1", "prompt": "secret prompt", "max_tokens": 3}))
    mem.send("standard", *signed("globex", SECRET_B, {"id": "au2", "prompt": "x", "reply_to": "elsewhere"}))
    mem.send("standard", J({"id": "au3", "prompt": "x"}), b"au3")  # unsigned: dead-lettered
    async with running(mem):
        assert await until(mem.all_committed)
        # the id again once answered: re-sent from the store
        mem.send("standard", *signed("acme", SECRET_A, {"id": "au1", "prompt": "secret prompt", "max_tokens": 3}))
        assert await until(mem.all_committed)
        assert await until(lambda: len(mem.audit()) == 5)
    by = {(a.id, a.outcome): a for a in mem.audit()}
    ran = by[("au1", "length")]
    assert ran.tenant == "acme" and ran.latency_class == "standard" and ran.kind == "generate"
    assert ran.completion_tokens == 3 and ran.source.offset == 1 and ran.worker and ran.answered_ms > 0
    assert ran.prompt is None and ran.text is None  # content only with SLUICE_AUDIT_CONTENT
    # the same id twice in one batch: the later record claims it, the earlier one is superseded
    assert by[("au1", "superseded")].source.offset == 0
    assert by[("au1", "duplicate")].source.offset == 4
    assert by[("au2", "invalid_request")].message.startswith("reply_to")
    assert by[(None, "invalid_request")].tenant is None  # the unsigned record: no id, no tenant
    offsets = sorted(a.source.offset for a in mem.audit())
    assert offsets == [0, 1, 2, 3, 4]  # one per record


async def test_audit_content_includes_prompt_and_text_when_enabled():
    mem = Memory(partitions=1, audit_content=True)
    mem.send("standard", J({"id": "c1", "prompt": "the prompt", "max_tokens": 2}), b"c1")
    async with running(mem):
        assert await until(lambda: len(mem.audit()) == 1)
    [record] = mem.audit()
    done = mem.finals()["c1"][0]
    assert record.prompt == "the prompt" and record.text == done.text and record.tenant == "default"


async def test_topic_mode_takes_the_tenant_from_a_dedicated_topic(tenants_file):
    from topics import Catalog, Topic
    from worker.worker import Worker

    dedicated = Topic(name="acme.requests.realtime", role="requests", partitions=1, latency_class="realtime",
                      tenant="acme")
    catalog = Catalog(CATALOG.topic + [dedicated])
    assert catalog.request_topic("realtime").tenant is None and catalog.request_topic("realtime", "acme") == dedicated
    mem = Memory(partitions=1, tenancy_mode="topic", tenancy_tenants_file=tenants_file)
    shared = CATALOG.request_topic("realtime").name
    body = {"id": "same", "prompt": "x", "max_tokens": 2, "tenant": "acme", "reply_to": "acme.replies"}
    mem.broker.append(dedicated.name, J(body), b"same")  # acme's topic: acme's reply_to is allowed
    mem.broker.append(shared, J(body), b"same")  # the shared topic: the default tenant, whatever the field says
    w = Worker(mem.settings, catalog, mem.engine, **mem.clients())
    await w.start()
    try:
        assert await until(lambda: len(mem.audit()) == 2)
        assert set(w.liveness.polls) == {"realtime", "realtime/acme", "standard", "batch"}
        assert set(w.paused) == {"realtime", "standard", "batch"}
    finally:
        await w.stop(grace_s=1)
    by_tenant = {a.tenant: a for a in mem.audit()}
    assert by_tenant["acme"].outcome == "length" and by_tenant["acme"].source.topic == dedicated.name
    assert by_tenant["default"].outcome == "invalid_request"  # acme.replies is not the default tenant's
    assert "acme:same" in mem.answers.answers and "default:same" not in mem.answers.answers
    assert isinstance(mem.finals()["same"][0], ErrorReply)  # the refusal, on the default reply topic
    assert any(b'"type":"done"' in r.value for r in mem.broker.records("acme.replies"))


def test_a_catalog_names_each_class_and_tenant_once():
    from topics import Catalog, Topic

    twice = Topic(name="x.realtime", role="requests", partitions=1, latency_class="realtime")
    with pytest.raises(ValueError, match="distinct"):
        Catalog(CATALOG.topic + [twice])
    with pytest.raises(ValueError, match="only request topics"):
        Catalog([t for t in CATALOG.topic if t.role != "audit"]
                + [Topic(name="x.audit", role="audit", partitions=1, tenant="acme")])


def test_a_producer_signer_from_a_key_file_makes_records_the_worker_verifies(tenants_file, tmp_path):
    from schemas.signing import Signer

    key_file = tmp_path / "acme.key"
    key_file.write_text(base64.b64encode(SECRET_A).decode() + "\n")
    signer = Signer.from_key_file("acme", str(key_file), "k1")
    value = J({"id": "s1", "prompt": "x"})
    assert tenancy(tenants_file).tenant_of(record(value, b"s1", signer.headers(b"s1", value)),
                                           Request(id="s1")) == "acme"
    assert Signer.from_key_file("acme", None).headers(b"s1", value) == []  # topic and single modes sign nothing
    with pytest.raises(ValueError, match="needs --tenant"):
        Signer.from_key_file(None, str(key_file))
    key_file.write_text("not base64!")
    with pytest.raises(ValueError, match="signing key file"):
        Signer.from_key_file("acme", str(key_file))


async def test_no_reply_to_pattern_opens_the_workers_own_topics():
    """An operator's pattern broad enough to match everything (`.*`) still never lets a request send
    its replies into a request topic (they would be read again as requests), the dead-letter topic
    or the audit topic: refused `invalid_request` on the default reply topic, nothing written there."""
    own = [CATALOG.request_topic("realtime").name, CATALOG.request_topic("batch").name, CATALOG.dlq.name,
           CATALOG.audit.name]
    mem = Memory(partitions=1, tenancy_reply_to=".*")
    for i, topic in enumerate(own):
        mem.send("standard", J({"id": f"loop{i}", "prompt": "x", "max_tokens": 2, "reply_to": topic}), f"loop{i}".encode())
    mem.send("standard", J({"id": "open", "prompt": "x", "max_tokens": 2, "reply_to": "team.replies"}), b"open")
    async with running(mem):
        assert await until(mem.all_committed)
    for i, topic in enumerate(own):
        [refused] = mem.finals()[f"loop{i}"]
        assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.INVALID_REQUEST
        assert "own request, dead-letter or audit" in refused.message
    assert len(mem.broker.records(own[0])) == 0 and len(mem.broker.records(own[1])) == 0
    assert not mem.broker.records(CATALOG.dlq.name)
    assert {a.id for a in mem.audit()} >= {"open", "loop0"}  # the audit topic holds audit records only
    assert isinstance(mem.finals(everywhere=True)["open"][0], DoneReply)  # the pattern opens other topics


async def test_a_class_dedicated_pool_keeps_the_other_classes_request_topics_closed_too():
    """A realtime-only worker does not read the batch request topic, but a batch-only pool does:
    replies sent there would be read again as requests by that pool."""
    batch_topic = CATALOG.request_topic("batch").name
    mem = Memory(partitions=1, tenancy_reply_to=".*", classes="realtime")
    mem.send("realtime", J({"id": "cross", "prompt": "x", "max_tokens": 2, "reply_to": batch_topic}))
    async with running(mem):
        assert await until(mem.all_committed)
    [refused] = mem.finals()["cross"]
    assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.INVALID_REQUEST
    assert "own request, dead-letter or audit" in refused.message
    assert mem.broker.records(batch_topic) == []


async def test_a_reply_to_topic_that_does_not_exist_is_refused_before_the_request_runs():
    """On a broker that does not create topics, a `reply_to` inside the tenant's pattern naming a
    topic that does not exist would have had every record of its stream wait out the producer's
    metadata timeout. It is refused `invalid_request` on the default reply topic before it runs;
    an existing topic under the same pattern is served, and the worker keeps serving."""
    mem = Memory(partitions=1, tenancy_reply_to=r"team\..*")
    mem.broker.auto_create = False
    mem.broker.create(REPLIES, CATALOG.dlq.name, CATALOG.audit.name, "team.replies")
    for i in range(3):
        mem.send("standard", J({"id": f"gone{i}", "prompt": "x", "max_tokens": 4, "reply_to": "team.gone"}))
    mem.send("standard", J({"id": "there", "prompt": "x", "max_tokens": 4, "reply_to": "team.replies"}))
    mem.send("standard", J({"id": "plain", "prompt": "x", "max_tokens": 4}))
    async with running(mem) as worker:
        assert await until(mem.all_committed)
        assert worker.ready
    finals = mem.finals()
    for i in range(3):
        [refused] = finals[f"gone{i}"]
        assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.INVALID_REQUEST
        assert refused.message == "reply_to 'team.gone' does not exist"
    assert not mem.broker.exists("team.gone") and not [r for r in mem.engine.started if "gone" in r]
    assert len(mem.engine.started) == 2
    assert isinstance(mem.finals(everywhere=True)["there"][0], DoneReply)
    assert isinstance(finals["plain"][0], DoneReply)
