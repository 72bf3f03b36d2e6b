"""Per-class latency and throughput from request timings; JSON, PNG and markdown outputs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loadgen.burst import percentile

QUANTILES = (50, 90, 99)


@dataclass
class Timing:
    """One request as the client saw it (seconds on one monotonic clock)."""

    latency_class: str
    sent: float
    first_token: float | None
    last_token: float | None
    done: float | None
    completion_tokens: int = 0
    error: str | None = None


def _q(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": (percentile(values, q) if values else None) for q in QUANTILES}


def summarize(timings: list[Timing]) -> dict:
    """TTFT, inter-token latency, end-to-end per class and overall; throughput over the run."""
    start = min((t.sent for t in timings), default=0.0)
    end = max((t.done for t in timings if t.done), default=start)
    out = {}
    for cls in ("realtime", "standard", "batch", "all"):
        group = [t for t in timings if cls == "all" or t.latency_class == cls]
        if not group:
            continue
        ok = [t for t in group if t.done is not None and t.error is None]
        ttft = [t.first_token - t.sent for t in ok if t.first_token is not None]
        # Token records are coalesced, so inter-token latency is the mean gap over each stream.
        itl = [(t.last_token - t.first_token) / (t.completion_tokens - 1) for t in ok
               if t.first_token is not None and t.last_token is not None and t.completion_tokens > 1]
        span = max(end - start, 1e-9)
        out[cls] = {
            "requests": len(group),
            "completed": len(ok),
            "errors": sum(t.error is not None for t in group),
            "unanswered": sum(t.done is None for t in group),
            "ttft_s": _q(ttft),
            "itl_s": _q(itl),
            "e2e_s": _q([t.done - t.sent for t in ok]),
            "requests_per_s": len(ok) / span,
            "tokens_per_s": sum(t.completion_tokens for t in ok) / span,
        }
    return out


def write_json(summary: dict, meta: dict, path: Path) -> None:
    path.write_text(json.dumps({"meta": meta, "summary": summary}, indent=2) + "\n")


def write_markdown(summary: dict, meta: dict, path: Path) -> None:
    rows = [f"# sluice loadgen: {meta.get('requests')} requests at {meta.get('rate')}/s ({meta.get('arrival')})", "",
            "| class | n | errors | TTFT p50/p99 (s) | ITL p50 (s) | e2e p50/p90/p99 (s) | req/s | tok/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(v):
        return "-" if v is None else f"{v:.3f}"

    for cls, s in summary.items():
        rows.append(f"| {cls} | {s['requests']} | {s['errors'] + s['unanswered']} | {f(s['ttft_s']['p50'])} / "
                    f"{f(s['ttft_s']['p99'])} | {f(s['itl_s']['p50'])} | {f(s['e2e_s']['p50'])} / "
                    f"{f(s['e2e_s']['p90'])} / {f(s['e2e_s']['p99'])} | {s['requests_per_s']:.2f} | "
                    f"{s['tokens_per_s']:.1f} |")
    path.write_text("\n".join(rows) + "\n")


def write_png(timings: list[Timing], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, tput) = plt.subplots(1, 2, figsize=(11, 4))
    start = min((t.sent for t in timings), default=0.0)
    for cls in ("realtime", "standard", "batch"):
        lat = sorted(t.done - t.sent for t in timings if t.latency_class == cls and t.done and not t.error)
        if lat:
            cdf.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=cls)
            done = sorted(t.done - start for t in timings if t.latency_class == cls and t.done)
            tput.plot(done, range(1, len(done) + 1), label=cls)
    cdf.set_xlabel("end-to-end latency (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("Latency CDF per class")
    tput.set_xlabel("time since start (s)")
    tput.set_ylabel("requests answered")
    tput.set_title("Throughput over time")
    for ax in (cdf, tput):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
