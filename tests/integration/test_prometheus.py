"""A real Prometheus (Debian's package) scrapes a worker on the real engine through a short burst;
the recording rules produce values and every metric the rules and dashboard read is scraped."""

import asyncio
import json
import subprocess
import urllib.parse
import urllib.request
import uuid

import pytest
import yaml

from loadgen.burst import run_burst
from schemas import DoneReply
from tests.integration.helpers import running_worker
from tests.tools import need_tool
from tests.unit.test_monitoring import RULES, recorded_names, referenced_names, sluice_sample_names
from tests.unit.test_supervision import free_port
from tests.unit.test_templates import EVENT
from worker.ops import OpsServer

pytestmark = pytest.mark.integration


def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def query(port: int, expr: str) -> dict[str, float]:
    """{class or '' -> value} of an instant query."""
    return {s["metric"].get("class", ""): float(s["value"][1]) for s in api(port, "query", query=expr)["result"]}


@pytest.fixture
def prometheus(tmp_path):
    binary = need_tool("prometheus")
    port, target = free_port(), free_port()
    # The shipped rules, evaluated every second instead of every 30 s so that a short test sees them.
    groups = yaml.safe_load(RULES.read_text())
    for g in groups["groups"]:
        g["interval"] = "1s"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [{"job_name": "sluice-workers", "static_configs": [{"targets": [f"127.0.0.1:{target}"]}]}],
    }))
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    try:
        yield port, target
    finally:
        proc.terminate()
        proc.wait(30)


async def until_value(port: int, expr: str, classes=(), timeout_s: float = 90) -> dict[str, float]:
    """The query's values once it has one (for each of `classes`, if given)."""
    values = {}
    for _ in range(int(timeout_s * 2)):
        values = await asyncio.to_thread(query, port, expr)
        if values and set(classes) <= set(values):
            return values
        await asyncio.sleep(0.5)
    raise AssertionError(f"{expr}: {values} after {timeout_s} s")


async def test_prometheus_scrapes_a_worker_and_the_rules_produce_values(prometheus, settings, catalog, engine,
                                                                        group_id):
    port, target = prometheus
    requests = [("realtime", {"id": f"p-{uuid.uuid4().hex[:6]}-{i}", "prompt": f"Count to {i}.", "max_tokens": 8})
                for i in range(4)]
    requests += [("standard", {"id": f"s-{uuid.uuid4().hex[:6]}", "kind": "score", "template": "fraud",
                               "event": EVENT})]
    # the tenant label is the operator's tenant (tenancy single), never what a record says
    async with running_worker(settings, catalog, engine, group_id=group_id, tenancy_tenant="payments") as worker:
        ops = OpsServer("127.0.0.1", target, worker.health)  # as `sluice worker` serves it (worker/service.py)
        await ops.start()
        await until_value(port, 'up{job="sluice-workers"} == 1')
        outcomes = await run_burst(settings.kafka.options(), catalog, requests, timeout_s=300)
        assert all(isinstance(o.final, DoneReply) for o in outcomes.values()), outcomes

        completed = await until_value(port, "class:sluice_requests_completed:rate5m > 0", {"realtime", "standard"})
        assert "batch" not in completed  # no batch requests were sent
        assert (await until_value(port, "class:sluice_end_to_end_seconds:p99_5m > 0", {"realtime"}))["realtime"] < 300
        slo = await until_value(port, "class:sluice_slo_seconds:max", {"realtime", "standard", "batch"})
        assert slo == {"realtime": 0.5, "standard": 5.0, "batch": 600.0}  # topics/default.toml
        assert await until_value(port, "template_label:sluice_score:mean1h")
        assert await until_value(port, 'sluice_tenant_requests_total{tenant="payments"} > 0')
        assert await until_value(port, "sluice_ready == 1")
        assert await until_value(port, "vllm:generation_tokens_total > 0")  # the engine's own, same target

        scraped = set(await asyncio.to_thread(api, port, "label/__name__/values"))
        await ops.stop()
    # Every name the rules and dashboard read, and every name worker/metrics.py declares, is in
    # Prometheus, but for those whose labels are free text and appear with their first event.
    only_on_event = {"sluice_worker_failures_total", "sluice_intake_errors_total"}
    missing = (referenced_names() - recorded_names() - {"up"}) - scraped - only_on_event
    assert missing == set(), missing
    missing = sluice_sample_names() - scraped - only_on_event
    assert missing == set(), missing
    assert recorded_names() & scraped >= {"class:sluice_requests_completed:rate5m", "class:sluice_slo_seconds:max"}
