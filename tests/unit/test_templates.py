"""Score templates: lookup, rendering, and the errors a producer sees for bad events."""

import pytest

from schemas.templates import TemplateError, Templates

EVENT = {"id": "t1", "timestamp": "2026-11-30T10:00:00Z", "amount": 912.5, "currency": "EUR",
         "merchant_id": "m-77", "mcc": "5732", "country": "NG", "channel": "ecommerce", "card_present": False,
         "customer_id": "c-9", "txn_count_24h": 7, "txn_sum_24h": 2400.0, "distinct_countries_24h": 3}


def test_builtin_fraud_template_renders_every_field():
    t = Templates().get("fraud")
    text = t.render(EVENT)
    for value in ("912.5 EUR", "m-77", "5732", "NG", "ecommerce", "c-9", "7 transactions"):
        assert value in text
    assert list(t.labels) == ["legit", "fraud"]


@pytest.mark.parametrize("drop", ["amount", "mcc", "channel", "customer_id"])
def test_missing_event_field_is_named(drop):
    event = {k: v for k, v in EVENT.items() if k != drop}
    with pytest.raises(TemplateError, match=f"`{drop}`"):
        Templates().get("fraud").render(event)


def test_invalid_field_value_is_named():
    with pytest.raises(TemplateError, match="currency"):
        Templates().get("fraud").render({**EVENT, "currency": "euro"})


def test_unknown_template_lists_the_known_ones():
    with pytest.raises(TemplateError, match=r"unknown template `nope`; known: .*fraud"):
        Templates().get("nope")
    with pytest.raises(TemplateError, match="unknown template"):
        Templates().get("../../etc/passwd")


def test_user_templates_add_and_override(tmp_path):
    (tmp_path / "chargeback.toml").write_text(
        'labels = ["won", "lost"]\nchat = false\nprompt = "Dispute of {amount}. Outcome:"\n')
    (tmp_path / "fraud.toml").write_text('prompt = "custom {id}"\n')
    ts = Templates(tmp_path)
    assert ts.get("chargeback").render({"amount": 3}) == "Dispute of 3. Outcome:"
    assert ts.get("fraud").render({"id": "x"}) == "custom x"  # overrides the built-in
    assert "chargeback" in ts.names() and "fraud" in ts.names()
    with pytest.raises(TemplateError, match="needs event field `amount`"):
        ts.get("chargeback").render({})


def test_broken_template_file_is_an_error_not_a_crash(tmp_path):
    (tmp_path / "bad.toml").write_text('prompt = "x"\nlabels = ["only"]\n')
    (tmp_path / "worse.toml").write_text('prompt = \n')
    with pytest.raises(TemplateError, match="two distinct labels"):
        Templates(tmp_path).get("bad")
    with pytest.raises(TemplateError, match="invalid"):
        Templates(tmp_path).get("worse")
    (tmp_path / "plain.toml").write_text('prompt = "x {id}"\nchat = false\nsystem = "You are careful."\n')
    with pytest.raises(TemplateError, match="`system` needs `chat = true`"):
        Templates(tmp_path).get("plain")


@pytest.mark.parametrize("amount", [[1, 2], {"v": 1}, None, "12", 10 ** 400])
def test_a_value_the_templates_format_cannot_take_is_a_bad_event_not_an_internal_error(tmp_path, amount):
    """A template without an event schema that formats a field (`{amount:.2f}`) is given whatever
    the producer sent: a list or an object there was a TypeError, answered `internal` with a
    traceback on every such request. It is the event that is wrong."""
    (tmp_path / "fee.toml").write_text('labels = ["low", "high"]\nprompt = "Fee of {amount:.2f}. Level:"\n')
    with pytest.raises(TemplateError, match="cannot render this event"):
        Templates(tmp_path).get("fee").render({"amount": amount})
    assert Templates(tmp_path).get("fee").render({"amount": 3}) == "Fee of 3.00. Level:"
