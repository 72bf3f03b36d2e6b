"""`sluice demo`: embedded stack, bundled model, one worker, a burst of requests, results shown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

DEMO_METRICS_PORT = 19464


def _wait_ready(proc: subprocess.Popen, port: int, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    with tqdm(desc="worker starting (vLLM engine load)", bar_format="{desc}: {elapsed}", mininterval=2) as bar:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}; see .sluice/demo-worker.log")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
            bar.update(0)
    raise RuntimeError("worker not ready in time; see .sluice/demo-worker.log")


def main(args) -> int:
    import topics
    from loadgen.burst import make_requests, report, run_burst
    from topics.admin import apply
    from worker import devstack
    from worker.model import prepare
    from worker.settings import load

    state = devstack.DEFAULT_DIR
    was_up = devstack.status(state).get("broker", "").startswith("up")
    devstack.up(state)
    env = dict(os.environ, SLUICE_KAFKA_IDEMPOTENCE="false", SLUICE_METRICS_PORT=str(DEMO_METRICS_PORT),
               SLUICE_GROUP_ID="sluice-demo", SLUICE_LOG_LEVEL="warning")
    settings = load(environ=env)
    catalog = topics.load(settings.worker.topics_file)
    worker = None
    try:
        prepare(Path(settings.engine.model))
        missing, _ = asyncio.run(apply(settings.kafka.options(), catalog))
        print(f"topics: {len(missing)} created, {len(catalog.topic) - len(missing)} present")
        log = open(".sluice/demo-worker.log", "ab")
        worker = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker"], env=env, stdout=log, stderr=log)
        _wait_ready(worker, DEMO_METRICS_PORT)

        requests = make_requests(args.requests, seed=int(time.time()), prefix=f"demo{int(time.time())}")
        watched = requests[0][1]["id"]
        print(f"\nsending {len(requests)} requests (realtime/standard/batch); streaming {watched}:\n")

        def on_token(reply):
            if reply.id == watched:
                print(reply.text, end="", flush=True)

        outcomes = asyncio.run(run_burst(settings.kafka.options(), catalog, requests, on_token=on_token))
        print("\n")
        print(report(outcomes))
        problems = {rid: o.problems for rid, o in outcomes.items() if o.problems}
        if problems:
            print(f"\ncontract problems in {len(problems)} requests: {list(problems.items())[:3]}")
            return 1
        print("\nevery request answered once; token seqs gapless; texts join to done.text")
        return 0
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:
                worker.kill()
        if not was_up and not args.keep_up:
            devstack.down(state)
