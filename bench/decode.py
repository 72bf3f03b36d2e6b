"""What reading one request costs the worker's event loop, by what its text holds.

    python bench/decode.py [--reps 5] [--calls 20]

Intake decodes every record on the event loop (`RequestCodec.decode`), so while it runs no stream
of the worker moves. Before decoding, JSON nesting is counted over the record's bytes with its
strings blanked (`schemas/codec.py: json_depth_exceeds`), but only when the record holds more
opening brackets than the limit: a prompt of prose skips it, a prompt of source code or of JSON
examples does not. Two arms, rotated over `--reps` repetitions, in this one process:

  unrolled  the worker as it runs: strings matched as runs of plain bytes between escapes
  per-byte  the pattern the worker used before rev bdb4826 (`"(?:[^"\\\\]|\\\\.)*"`), which steps
            once per byte

Both arms decode the same records to the same answer (checked). Prompts: `prose` (words, no
brackets) and `code` (this repository's Python source), as a chat message of 16-900 KiB. Prints the
median time per call for each arm (median over the repetitions [min-max]) and per-byte / unrolled;
plots time against size (bench/decode.png).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import msgspec
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common, harness  # noqa: E402
from bench.pauses import write_json  # noqa: E402
from schemas import BadRequest, Limits, RequestCodec  # noqa: E402
from schemas import codec as codec_module  # noqa: E402

OUT = Path(__file__).resolve().parent
ARMS = ["unrolled", "per-byte"]
PATTERNS = {"unrolled": codec_module._JSON_STRING,
            "per-byte": re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)}
SIZES_KIB = (16, 64, 256, 900)
ROOT = Path(__file__).resolve().parent.parent


def texts() -> dict[str, str]:
    code = "\n".join(p.read_text() for p in sorted((ROOT / "worker").glob("*.py")))
    prose = "The payments team scores every card transaction in real time and reads the answer. " * 20000
    return {"prose": prose, "code": code * (1 + 1_000_000 // len(code))}


def records() -> dict[tuple[str, int], bytes]:
    return {(kind, kib): msgspec.json.encode({"id": f"{kind}-{kib}", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": text[:kib * 1024]}]})
            for kind, text in texts().items() for kib in SIZES_KIB}


def seconds_per_call(codec: RequestCodec, record: bytes, calls: int) -> tuple[float, str]:
    start = time.perf_counter()
    for _ in range(calls):
        try:
            answer = codec.decode(record).id
        except BadRequest as exc:  # the request itself is fine; kept for the equality check
            answer = f"refused: {exc.message}"
    return (time.perf_counter() - start) / calls, answer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="decodes per record, arm and repetition")
    args = p.parse_args()
    codec = RequestCodec(Limits(max_record_bytes=2 << 20))  # room for the 900 KiB records
    recs = records()
    times: dict[str, dict[str, list[float]]] = {arm: {} for arm in ARMS}
    answers: dict[str, dict[str, str]] = {arm: {} for arm in ARMS}
    with tqdm(total=args.reps * len(ARMS) * len(recs), desc="decoding", unit="record") as bar:
        for order in harness.orders(ARMS, args.reps):
            for arm in order:
                codec_module._JSON_STRING = PATTERNS[arm]
                try:
                    for (kind, kib), record in recs.items():
                        t, answers[arm][f"{kind}-{kib}"] = seconds_per_call(codec, record, args.calls)
                        times[arm].setdefault(f"{kind}-{kib}", []).append(t * 1000)
                        bar.update()
                finally:
                    codec_module._JSON_STRING = PATTERNS["unrolled"]
    if answers["unrolled"] != answers["per-byte"]:
        sys.exit(f"the arms decoded differently: {answers}")
    print(f"\n{common.machine()}, rev {common.git_rev()}, {args.reps} repetitions of {args.calls} calls per record")
    print(f"{'record':>10} {'unrolled ms':>20} {'per-byte ms':>22} {'per-byte/unrolled':>18}")
    out = {arm: {name: harness.spread(ts) for name, ts in by.items()} for arm, by in times.items()}
    for name in times["unrolled"]:
        u, b = out["unrolled"][name], out["per-byte"][name]
        print(f"{name:>10} {u['median']:>9.3f} [{u['min']:.3f}-{u['max']:.3f}] "
              f"{b['median']:>9.3f} [{b['min']:.3f}-{b['max']:.3f}] {b['median'] / u['median']:>10.1f}")
    out["ratio_per_byte_over_unrolled"] = {name: out["per-byte"][name]["median"] / out["unrolled"][name]["median"]
                                           for name in times["unrolled"]}
    write_json(OUT / "decode.json", args, out)
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, style in (("unrolled", "-"), ("per-byte", "--")):
        for kind, marker in (("code", "o"), ("prose", "s")):
            ys = [out[arm][f"{kind}-{kib}"]["median"] for kib in SIZES_KIB]
            ax.plot(SIZES_KIB, ys, style, marker=marker, label=f"{arm}, {kind}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("chat message size (KiB)")
    ax.set_ylabel("decode time per record (ms, median)")
    ax.set_title("Reading one request on the event loop")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "decode.png", dpi=110)
    code = [r for name, r in out["ratio_per_byte_over_unrolled"].items() if name.startswith("code")]
    print(f"wrote {OUT / 'decode.json'} and {OUT / 'decode.png'}; per-byte/unrolled on code "
          f"{min(code):.1f}-{max(code):.1f} (median {statistics.median(code):.1f})")


if __name__ == "__main__":
    main()
