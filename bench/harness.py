"""Like with like: what every comparison checks before it prints a ratio.

Each arm runs in its own process and reports, in its own log, the engine configuration vLLM
resolved for it (`worker.engine.describe_config`: a JSON line after `ARM-ENGINE ` from bench
processes, the worker's `engine_ready` log line), the KV cache vLLM sized, and the CPU cores its
engine computes on. `check_alike` stops the run when arms differ in any of them, and
`check_outputs` when they generated different tokens for the same request. Arms run in a
rotated order per repetition (`orders`), and results are reported as median and spread
(`spread`). Pure Python, no vLLM import: unit-tested with tables of logs.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from bench.common import binding

ARM_ENGINE = "ARM-ENGINE "
# The settings whose difference would make a ratio mislead. `kv_connector` is not among them:
# arms with and without KV pages differ in it on purpose (the binding check still covers the
# core reservation vLLM makes for a connector).
COMPARED = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "chunked_prefill",
            "scheduling_policy", "prefix_caching", "block_size", "kv_cache_dtype", "enforce_eager", "executor",
            "onednn_cache", "kv_cache_tokens", "core_ids")


def engine_config(log_text: str) -> dict | None:
    """The last engine configuration an arm reported in its log."""
    found = None
    for line in log_text.splitlines():
        if ARM_ENGINE in line:
            found = json.loads(line.split(ARM_ENGINE, 1)[1])
        elif '"engine_ready"' in line:
            try:
                found = {k: v for k, v in json.loads(line).items() if k not in ("event", "level", "timestamp")}
            except ValueError:
                continue
    return found


def kv_cache_tokens(log_text: str) -> int | None:
    """vLLM's 'KV cache size: 116,480 tokens' line (the last one)."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log_text)
    return int(found[-1].replace(",", "")) if found else None


def arm_report(log_text: str) -> dict:
    """One arm's resolved configuration, KV cache size and CPU binding, from its own log."""
    found = binding(log_text)
    return {**(engine_config(log_text) or {}), "kv_cache_tokens": kv_cache_tokens(log_text),
            "core_ids": found.split("core ids=")[1].split("]")[0] + "]" if found else None, "binding": found}


def check_alike(reports: dict[str, dict]) -> None:
    """Raises SystemExit naming every setting the arms do not share (or did not report)."""
    problems = []
    for key in COMPARED:
        values = {name: r.get(key) for name, r in reports.items()}
        if any(v is None for v in values.values()) or len({json.dumps(v) for v in values.values()}) > 1:
            problems.append(f"  {key}: " + ", ".join(f"{n}={v}" for n, v in values.items()))
    if problems:
        raise SystemExit("arms are not configured alike, so their ratio would mislead:\n" + "\n".join(problems))


def check_outputs(outputs: dict[str, dict[str, list[int]]]) -> int:
    """Every arm generated the same token ids for every request; returns the requests compared.
    Raises SystemExit with the count and the first difference otherwise."""
    names = list(outputs)
    ref = outputs[names[0]]
    problems = []
    for name in names[1:]:
        other = outputs[name]
        if set(other) != set(ref):
            problems.append(f"  {name}: {len(set(ref) ^ set(other))} requests answered in one arm only")
            continue
        differ = [k for k in ref if other[k] != ref[k]]
        if differ:
            k = differ[0]
            at = next((i for i, (a, b) in enumerate(zip(ref[k], other[k])) if a != b), min(len(ref[k]), len(other[k])))
            problems.append(f"  {name}: {len(differ)} of {len(ref)} requests differ from {names[0]}; first {k!r} at "
                            f"token {at} (lengths {len(ref[k])} and {len(other[k])})")
    if problems:
        raise SystemExit("arms generated different tokens, so they did different work:\n" + "\n".join(problems))
    return len(ref)


def orders(arms: list[str], reps: int) -> list[list[str]]:
    """Repetition i runs the arms rotated by i, so each arm runs first, middle and last in turn."""
    return [arms[i % len(arms):] + arms[:i % len(arms)] for i in range(reps)]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time used so far by a process ("front": the process itself: its event loop, clients,
    tokenizer, output handling) and by its descendants ("engine": vLLM's engine core and workers)."""
    import psutil

    def used(p) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    root = psutil.Process(pid)
    return {"front": used(root), "engine": sum(used(c) for c in root.children(recursive=True))}


def dev_stack_processes(pattern: str, state=None) -> dict[str, object]:
    """pid-file stem -> psutil process of each running service `sluice dev up` started whose pid
    file matches `pattern` (e.g. "redis-*.pid": "redis-17001" -> its process)."""
    import psutil

    from worker import devstack

    out = {}
    for pidfile in sorted(Path(state or devstack.DEFAULT_DIR).glob(pattern)):
        try:
            out[pidfile.stem] = psutil.Process(int(pidfile.read_text().strip()))
        except (ValueError, OSError, psutil.Error):
            continue
    return out


def process_cpu_seconds(p) -> float:
    t = p.cpu_times()
    return t.user + t.system


def service_cpu_seconds(state=None) -> dict[str, float]:
    """CPU time used so far by the local services `sluice dev up` started ("redis": every Redis
    Cluster node, replicas included; "broker"), found by their pid files. NaN for a service not
    started that way: its CPU is not on this machine's books, or not known."""
    import psutil

    out = {}
    for name, pattern in (("redis", "redis-*.pid"), ("broker", "broker.pid")):
        total, found = 0.0, False
        for p in dev_stack_processes(pattern, state).values():
            try:
                total, found = total + process_cpu_seconds(p), True
            except psutil.Error:
                continue
        out[name] = total if found else float("nan")
    return out
