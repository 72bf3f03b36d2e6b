"""deploy/monitoring: the rules pass their promtool unit tests, and every query in the rules and the
dashboard is valid PromQL over metrics a worker really exports (vLLM's checked against vLLM's source)."""

import json
import re
import shlex
import subprocess
from pathlib import Path

import prometheus_client
import yaml

from tests.tools import need_tool
from worker import metrics
from worker.settings import FLAT

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
RULES = MONITORING / "rules.yaml"
DASHBOARD = MONITORING / "dashboard.json"
# PromQL words that are not metric names.
_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
          "inf", "nan"}


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def recorded_names() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", ())]


def as_promql(expr: str) -> str:
    """Grafana's variables replaced by what they stand for at query time."""
    return expr.replace("$__rate_interval", "5m").replace("$class", ".*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (selectors), not functions, labels or keywords."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # strings (label values, format strings)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if rest.startswith("(") or m.group().lower() in _WORDS or re.fullmatch(r"\d+[smhdwy]", m.group()):
            continue
        if expr[m.start() - 1:m.start()].isdigit() or expr[m.start() - 1:m.start()] == ".":
            continue  # the unit of a number, e.g. 5m
        names.add(m.group())
    return names


def sluice_sample_names() -> set[str]:
    """Every sample name worker/metrics.py can export."""
    out = set()
    for family in metrics.REGISTRY.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}[family.type]
        out |= {family.name + s for s in suffixes}
    return out


def process_sample_names() -> set[str]:
    """What the process-wide registry's own collectors export on a worker's target (worker/ops.py)."""
    return {sample.name for family in prometheus_client.REGISTRY.collect()
            if family.name.startswith(("process_", "python_")) for sample in family.samples}


def vllm_metric_names() -> set[str]:
    """vLLM's metric names as its Prometheus logger declares them (counters get _total when exported)."""
    loggers = Path(__import__("vllm").__file__).parent / "v1" / "metrics" / "loggers.py"
    declared = set(re.findall(r'"(vllm:[a-z_]+)"', loggers.read_text()))
    return declared | {n + s for n in declared for s in ("_total", "_bucket", "_sum", "_count")}


def referenced_names() -> set[str]:
    exprs = [r["expr"] for r in rules()] + [as_promql(q) for q in dashboard_queries()]
    return set().union(*map(metric_names, exprs))


def test_the_name_extractor_sees_selectors_only():
    assert metric_names('sum by (class, le) (rate(a_bucket{x="y"}[5m])) > on (class) b:rec') == {"a_bucket", "b:rec"}
    assert metric_names('topk(10, sum by (tenant) (rate(c_total[5m]))) / 2.5e3') == {"c_total"}


def test_promtool_rule_unit_tests_pass():
    promtool = need_tool("promtool", "prometheus")
    out = subprocess.run([promtool, "test", "rules", "rules_test.yaml"], cwd=MONITORING, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", (MONITORING / "rules_test.yaml").read_text()))
    assert tested == {r["alert"] for r in rules() if "alert" in r}  # every alert has a case


def test_every_dashboard_query_is_valid_promql(tmp_path):
    promtool = need_tool("promtool", "prometheus")
    as_rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": as_promql(q)}
                                                          for i, q in enumerate(dashboard_queries())]}]}
    (tmp_path / "dashboard_rules.yaml").write_text(yaml.safe_dump(as_rules))
    out = subprocess.run([promtool, "check", "rules", "dashboard_rules.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_queried_metric_is_exported():
    known = sluice_sample_names() | process_sample_names() | vllm_metric_names() | recorded_names() | {"up"}
    assert referenced_names() - known == set()
    assert any(n.startswith("vllm:") for n in referenced_names())  # the engine panels read vLLM's own metrics


def test_the_dashboard_covers_what_an_operator_asks_first():
    text = DASHBOARD.read_text()
    for needle in ("class:sluice_end_to_end_seconds:p99_5m", "class:sluice_slo_seconds:max",
                   "class:sluice_consumer_lag_records:sum", "sluice_requests_in_engine", "sluice_requests_waiting",
                   "sluice_prefill_tokens_total", "sluice_redis_up", 'route, code', "vllm:num_requests_running"):
        assert needle in text, needle
    ids = [p["id"] for p in json.loads(text)["panels"]]
    assert len(ids) == len(set(ids))


def test_the_readme_metrics_table_names_every_metric():
    readme = (MONITORING.parents[1] / "README.md").read_text()
    for family in metrics.REGISTRY.collect():
        shown = family.name + ("_total" if family.type == "counter" else "")
        assert f"| `{shown}` |" in readme, shown



def test_the_readme_alerts_table_names_every_alert():
    readme = (MONITORING.parents[1] / "README.md").read_text()
    table = readme.split("| alert | fires when |")[1].split("\n\n")[0]
    listed = {name for row in table.splitlines() if row.startswith("|") for name in re.findall(r"`(Sluice\w+)`", row.split("|")[1])}
    assert listed == {r["alert"] for r in rules() if "alert" in r}


RUNBOOK = MONITORING / "RUNBOOK.md"
_WORKER_SOURCES = "\n".join(p.read_text() for d in ("worker", "schemas", "topics")
                            for p in (Path(__file__).resolve().parents[2] / d).glob("*.py"))


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def test_every_alert_links_its_runbook_section():
    headings = set(re.findall(r"^## (\w+)$", RUNBOOK.read_text(), re.M))
    alerts = {r["alert"]: r["annotations"].get("runbook_url") for r in rules() if "alert" in r}
    assert headings == set(alerts), "one runbook section per alert, named as the alert"
    for name, url in alerts.items():
        assert url == f"deploy/monitoring/RUNBOOK.md#{name.lower()}", (name, url)  # GitHub's anchor of `## Name`


def test_the_runbook_commands_parse():
    from worker.cli import build_parser

    commands = [span for span in _code_spans(RUNBOOK.read_text()) if span.startswith("sluice ")]
    assert len(commands) >= 5
    for command in commands:
        argv = shlex.split(command.replace("<class>", "realtime"))[1:]
        build_parser().parse_args(argv)  # exits (and fails the test) on an option the CLI does not have


def test_the_runbook_names_only_real_metrics_settings_and_log_lines():
    text = RUNBOOK.read_text()
    # the samples a query reads, and a histogram by its family name (`sluice_stage_seconds{class, stage}`)
    exported = sluice_sample_names() | {f.name for f in metrics.REGISTRY.collect() if f.type == "histogram"}
    named = set(re.findall(r"\bsluice_[a-z_]+\b", text))
    assert named and named <= exported, named - exported
    settings = {f"SLUICE_{flat.upper()}" for flat in FLAT} | {"SLUICE_CONFIG"}
    variables = set(re.findall(r"\bSLUICE_[A-Z_]+\b", text))
    assert variables and variables <= settings, variables - settings
    # log events, readiness fields, label values, settings keys: each written somewhere in the code
    words = {s for s in _code_spans(text) if re.fullmatch(r"[a-z]+(_[a-z0-9]+)+", s) and not s.startswith("sluice_")}
    assert len(words) >= 10
    outside = {"runbook_url", "container_cpu_cfs_throttled_periods_total"}  # Prometheus's annotation, cAdvisor's metric
    assert {w for w in words - outside if not re.search(rf"\b{w}\b", _WORKER_SOURCES)} == set()


def test_the_runbook_failure_reasons_are_what_the_worker_says():
    """Each `failure` the runbook explains is text the supervisor or dispatcher writes."""
    table = RUNBOOK.read_text().split("| `failure` starts with |")[1].split("\n\n")[0]
    pieces = [span for row in table.splitlines()[2:] for span in _code_spans(row.split("|")[1]) if "<" not in span]
    assert len(pieces) >= 8
    assert [p for p in pieces if p not in _WORKER_SOURCES] == []
