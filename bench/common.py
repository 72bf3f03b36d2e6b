"""Shared set-up for benchmarks: embedded stack, model, one in-process engine, fresh topics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import topics
from topics.admin import apply
from worker import devstack
from worker.model import prepare
from worker.settings import load


def machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.machine()}"


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def settings(**env):
    devstack.up(log=lambda *_: None)
    model = prepare(log=lambda *_: None)
    base = {"SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_METRICS_PORT": "0", "SLUICE_MODEL": str(model),
            "SLUICE_LOG_LEVEL": "warning", "SLUICE_REDIS_KEY_PREFIX": f"bench-{uuid.uuid4().hex[:6]}"}
    from worker.logs import configure

    configure("warning", "console")
    return load(environ={**os.environ, **base, **env})


async def fresh_catalog(s, tag: str):
    cat = topics.load(s.worker.topics_file).renamed(f"b{tag}{uuid.uuid4().hex[:6]}.")
    await apply(s.kafka.options(), cat)
    return cat


async def engine(s):
    from worker.engine import VllmEngine

    return await asyncio.to_thread(VllmEngine, s)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def stage_totals(port: int, latency_class: str) -> dict[str, tuple[float, float]]:
    """A worker's `sluice_stage_seconds` (count, sum) per stage for one class, read from its /metrics."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "sluice_stage_seconds":
            continue
        for sample in family.samples:
            if sample.labels.get("class") == latency_class and sample.name.endswith(("_count", "_sum")):
                out.setdefault(sample.labels["stage"], [0.0, 0.0])[sample.name.endswith("_sum")] = sample.value
    return {stage: (c, t) for stage, (c, t) in out.items()}


async def scrape_metric(port: int, name: str, **labels) -> float:
    """Sum of the samples of one metric whose labels include `labels`, read from a worker's /metrics."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def stage_means_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds per stage over the requests answered between two `stage_totals` readings."""
    return {stage: 1000 * (t - before.get(stage, (0, 0))[1]) / (c - before.get(stage, (0, 0))[0])
            for stage, (c, t) in after.items() if c > before.get(stage, (0, 0))[0]}


async def wait_http(url: str, proc, timeout: float = 600, poll_s: float = 1.0) -> None:
    """Until `url` answers 200; fails early if `proc` exits."""
    import aiohttp

    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode}")
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(poll_s)
    raise TimeoutError(url)


def stop_process(proc, grace: float = 60) -> None:
    """SIGTERM the process group, SIGKILL it after `grace`; a group already gone is no error, and
    what is left of it (an engine whose worker died) is killed too."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.asynccontextmanager
async def worker_process(s, tag: str, log_path: Path, procs: list | None = None, **env):
    """`sluice worker` in its own process on fresh prefixed topics; yields the catalog once it is ready
    (and appends the process to `procs`, when given)."""
    prefix = f"{tag}{uuid.uuid4().hex[:6]}."
    root = Path(__file__).resolve().parent.parent
    topics_file = log_path.with_suffix(".topics.toml")
    topics_file.write_text((root / "topics" / "default.toml").read_text()
                           .replace('name = "sluice.', f'name = "{prefix}sluice.'))
    cat = topics.load(topics_file)
    await apply(s.kafka.options(), cat)
    port = int(env.get("SLUICE_METRICS_PORT") or free_port())  # a caller that scrapes /metrics picks it
    full = {**os.environ, "SLUICE_TOPICS_FILE": str(topics_file), "SLUICE_METRICS_PORT": str(port),
            "SLUICE_METRICS_HOST": "127.0.0.1", "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_MODEL": s.engine.model,
            "SLUICE_GROUP_ID": f"{tag}-{uuid.uuid4().hex[:6]}", "SLUICE_LOG_LEVEL": "warning",
            "SLUICE_REDIS_KEY_PREFIX": f"{tag}-{uuid.uuid4().hex[:6]}", **env}
    # vLLM logs to stdout (its CPU binding among it): both streams go to the log
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker"], env=full, cwd=root,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    if procs is not None:
        procs.append(proc)
    try:
        await wait_http(f"http://127.0.0.1:{port}/readyz", proc)
        yield cat
    finally:
        stop_process(proc)
        topics_file.unlink(missing_ok=True)


# Every arm of a comparison runs vLLM with the same engine arguments and the same CPU binding.
# vLLM on CPU reserves a core for its own scheduler, and one more when a KV connector is
# configured (sluice's); on a small machine the second request is dropped, so arms that look
# alike could compute on different cores. Each arm gets the same reservation, and its log's
# binding line is compared (`binding`, `same_binding`).
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def bench_engine_settings(args, **extra):
    """The engine settings of every arm, from the bench's arguments (one place for all of them)."""
    env = {"SLUICE_MAX_NUM_SEQS": str(args.max_num_seqs), "SLUICE_MAX_MODEL_LEN": str(args.max_model_len),
           "SLUICE_CPU_KVCACHE_GIB": str(args.kv_gib), "SLUICE_MODEL": args.model,
           "SLUICE_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
           # vLLM's own arms run its multiprocess executor, a spawned model runner: sluice's arms run the same,
           # not the worker's default one-process engine core, whose steps differ, unless a bench runs every
           # arm in-process (`--engine-start inprocess`: `inprocess_vllm_arm`)
           "SLUICE_ENGINE_START": getattr(args, "engine_start", "forkserver"), **extra}
    return load(environ={**os.environ, **env}), env


INPROCESS_ARM_ENV = "SLUICE_BENCH_ENGINE_INPROCESS"


def arm_env(args) -> dict:
    """Environment of a vLLM arm that is not a worker: the binding, KV cache and compile mode a worker's
    engine gets from its settings (`worker.engine.engine_env`), and whether it runs in-process."""
    from worker.engine import engine_env

    return {**os.environ, RESERVED_CPUS_ENV: str(args.reserved_cpus), "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
            INPROCESS_ARM_ENV: "1" if getattr(args, "engine_start", "forkserver") == "inprocess" else "0",
            **engine_env(load(environ=dict(os.environ)).engine)}


def inprocess_vllm_arm() -> dict[str, str] | None:
    """In a vLLM arm of a bench run with `--engine-start inprocess`, before vLLM starts: the engine core
    this process spawns is to run the model itself, as a sluice worker's does by default. Sets the
    binding and preloads vLLM would give its model runner (`worker.omp_binding`) in this process's
    environment, which the spawned engine core starts with, and returns them. None otherwise."""
    if os.environ.get(INPROCESS_ARM_ENV) != "1":
        return None
    from worker import omp_binding

    predicted = omp_binding.predict(dict(os.environ), kv_connector=False)
    if predicted is None:
        raise SystemExit("--engine-start inprocess: the model runner's binding cannot be worked out here")
    os.environ.update(predicted)
    return predicted


def check_inprocess_vllm_arm(vllm_config, predicted: dict[str, str]) -> None:
    """Stops the arm unless vLLM's own code chose the binding its engine core started with (and logs
    vLLM's binding line, which the harness reads like any arm's)."""
    from worker import omp_binding

    wanted = omp_binding.expected(vllm_config)
    if wanted != predicted:
        raise SystemExit(f"--engine-start inprocess: vLLM chose {wanted}, the engine core started with {predicted}")


def binding(log_text: str) -> str | None:
    """vLLM's CPU binding ('reserve_cpu_num=2, core ids=[0, 1], reserved_cpus=[]'), from the last
    lines an arm's engine logged about it (they come on three log lines)."""
    import re

    parts = []
    for pattern in (r"reserve_cpu_num=\d+", r"core ids=\[[^\]]*\]", r"reserved_cpus=\[[^\]]*\]"):
        found = re.findall(pattern, log_text)
        if not found:
            return None
        parts.append(found[-1])
    return ", ".join(parts)


def same_binding(logs: dict[str, str]) -> dict[str, str | None]:
    """Each arm's binding; raises when they differ (the comparison would not be like with like)."""
    found = {name: binding(text) for name, text in logs.items()}
    cores = {name: (b.split("core ids=")[1] if b else None) for name, b in found.items()}
    if len(set(cores.values())) > 1:
        raise SystemExit("arms computed on different cores, so their ratio would mislead:\n"
                         + "\n".join(f"  {k}: {v}" for k, v in found.items()))
    return found


def vllm_cli_flags(engine_args: dict) -> list[str]:
    """The same engine arguments as `vllm serve` flags."""
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


class ChildArm:
    """A benchmark arm in a child process that stays up across repetitions: it prints READY once
    warmed up, then answers each line written to its stdin with one `RESULT <json>` line. Everything
    it prints goes to `log_path` (vLLM logs to stdout: its configuration and CPU binding among it)."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: Path):
        self.name, self.cmd, self.env, self.log_path = name, cmd, env, log_path

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.cmd, cwd=Path(__file__).resolve().parent.parent, env=self.env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.log = open(self.log_path, "w")
        await self._line("READY")

    async def _line(self, prefix: str) -> str:
        while True:
            raw = await self.proc.stdout.readline()
            if not raw:
                raise RuntimeError(f"{self.name} arm exited; see {self.log_path}")
            line = raw.decode(errors="replace")
            self.log.write(line)
            self.log.flush()
            line = line.rsplit("\r", 1)[-1]  # after a progress bar's carriage returns
            if line.startswith(prefix):
                return line

    async def ask(self, command: str) -> dict:
        import json

        self.proc.stdin.write(f"{command}\n".encode())
        await self.proc.stdin.drain()
        return json.loads((await self._line("RESULT "))[7:])

    async def stop(self) -> None:
        self.proc.stdin.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 60)
        if self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        self.log.close()
