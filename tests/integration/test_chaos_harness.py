"""`sluice chaos` with the real engine, small: two `sluice worker` processes running vLLM and the
bundled model, valid and fuzzed records, and one of each fault that does not need a third worker
(SIGKILL, SIGSTOP past the session timeout, a Redis master killed, the broker paused past the
producers' request timeout). The auditor's loss and conflict columns must all be zero.

The full schedule at scale (10,000 requests, 3+ kills, join and leave) runs with the fake engine:
`sluice chaos --engine fake`, results in bench/RESULTS.md.
"""

import pytest

from loadgen.chaos import report
from loadgen.chaos.run import Run, Scenario
from worker import devstack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(1500)  # two engines compile beside the session's own on 2 cores; a restart compiles again
async def test_a_real_engine_chaos_run_loses_and_conflicts_nothing(settings, tmp_path):
    sc = Scenario(engine="vllm", requests=40, fuzz=40, rate=1.0, workers=2, faults="kill,pause,redis,broker",
                  seed=11, max_tokens=(4, 16), settle_s=420, ready_s=600, dev_dir=devstack.DEFAULT_DIR, out=tmp_path)
    result = await Run(sc, settings).main()
    text = report.markdown(result)
    assert result["failed"] == [], text
    c = result["counts"]
    assert c["requests"] == 40 and c["done"] + c["error"] == 40 and c["fuzzed"] + c["unsendable_fuzz"] == 40, text
    assert c["error"] == 0, text  # faults delay valid requests; they never turn them into errors
    assert sorted(label.split()[0] for _, _, label in result["spans"]) == ["broker", "kill", "pause", "redis"], text
    assert c["worker_exits"] >= 1, text  # the SIGKILLed worker, restarted by the harness
    paths = report.write(result, tmp_path / "report")
    assert all(p.stat().st_size > 0 for p in paths)
