"""A chaos run's report: a markdown table, the JSON behind it, and a timeline plot of faults,
throughput and requests in flight."""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.chaos.audit import FAILURES


def markdown(result: dict) -> str:
    c = result["counts"]
    lines = [f"# sluice chaos: {result['run']}", "",
             f"engine `{result['engine']}`, seed {result['seed']}, {result['workers']} workers at the start, "
             f"{result['seconds']:.0f} s", "", "| column | count | |", "| --- | ---: | --- |"]
    for name, value in c.items():
        mark = ("**FAIL**" if value else "ok") if name in FAILURES else ""
        lines.append(f"| {name} | {value} | {mark} |")
    if result["errors_by_code"]:
        lines += ["", "error replies to valid requests, by code: " +
                  ", ".join(f"`{k}` {v}" for k, v in sorted(result["errors_by_code"].items()))]
    lines += ["", "| t (s) | event | detail |", "| ---: | --- | --- |"]
    lines += [f"| {t:.1f} | {what} | {detail} |" for t, what, detail in result["events"]]
    for name in ("lost_ids", "violations", "uncommitted_partitions"):
        if result.get(name):
            lines += ["", f"{name} (first 20):", *[f"- {v}" for v in result[name][:20]]]
    lines += ["", f"verdict: {'FAILED: ' + ', '.join(result['failed']) if result['failed'] else 'every loss and conflict column is zero'}"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["series"]
    t = [s["t"] for s in series]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    top.plot(t, [s["answered_per_s"] for s in series], label="final replies / s", color="tab:blue")
    top.plot(t, [s["sent_per_s"] for s in series], label="requests sent / s", color="tab:gray", alpha=0.6)
    top.set_ylabel("per second")
    bottom.plot(t, [s["in_flight"] for s in series], label="requests in flight", color="tab:orange")
    bottom.set_ylabel("requests in flight")
    workers = bottom.twinx()
    workers.step(t, [s["workers"] for s in series], where="post", label="worker processes", color="tab:green")
    workers.set_ylabel("worker processes")
    workers.set_ylim(0, max([s["workers"] for s in series] or [1]) + 1)
    workers.legend(loc="upper left", fontsize=8)
    bottom.set_xlabel("seconds since the first request")
    colors = {"kill": "red", "pause": "purple", "join": "green", "leave": "olive", "redis": "brown", "broker": "black"}
    for start, end, label in result["spans"]:
        kind = label.split()[0]
        for ax in (top, bottom):
            ax.axvspan(start, max(end, start + 0.5), color=colors.get(kind, "gray"), alpha=0.15)
        top.annotate(label, (start, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                     va="top", ha="right")
    top.legend(loc="upper right", fontsize=8)
    bottom.legend(loc="upper right", fontsize=8)
    verdict = "FAILED: " + ", ".join(result["failed"]) if result["failed"] else "no loss, no conflict"
    fig.suptitle(f"sluice chaos {result['run']} ({result['engine']} engine): {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "chaos.json", out / "chaos.md", out / "chaos.png"]
    paths[0].write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths
