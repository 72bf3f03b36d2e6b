"""What sealing stored state costs (SLUICE_REDIS_ENCRYPTION_KEYS_FILE): per page, and on resume.

    python bench/sealing.py [--pages 200] [--resume-reps 2] [--prompts 4]

1. Per page, in this process: a SmolLM2 bfloat16 KV page (16 tokens x 23,040 bytes) is encoded
   and decoded as sluice stores it (header and CRC-32 check, the reference), then also sealed and
   opened with AES-256-GCM and with SM4-GCM. A `blake2b` arm adds the keyed BLAKE2b pass on each
   side that pages carried before CRC-32 (SLKV1). Prints MB/s and microseconds per token of KV for
   each, and each arm's cost per page as a ratio to the reference encode+decode.
2. On resume, end to end: `bench/resume.py` runs in its own process with pages in clear and
   with pages sealed (AES-256-GCM), alternating `--resume-reps` times; identical settings but
   the keys file. Prints the median pick-up-to-first-token with pages of each arm and their
   ratio. Writes bench/sealing.json.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402
from worker import kv_pages  # noqa: E402
from worker.sealing import CIPHERS, Sealer  # noqa: E402

OUT = Path(__file__).resolve().parent
PAGE_TOKENS, BYTES_PER_TOKEN = 16, 23_040  # SmolLM2-135M bfloat16: 30 layers x 2 x 3 heads x 64 x 2 bytes
SHAPE = (2, 16, 3, 64)  # one layer's page (K and V, tokens, heads, head dim); x 30 layers, bfloat16


def per_page(pages: int) -> dict:
    payload = os.urandom(PAGE_TOKENS * BYTES_PER_TOKEN)
    digest = os.urandom(32)
    name = kv_pages.key("bench", digest)

    def reference():
        value = kv_pages.encode(digest, "bfloat16", SHAPE, 30, payload)
        kv_pages.decode(digest, value, "bfloat16", SHAPE, 30, 2)
        return value

    def blake2b():  # the check SLKV1 pages carried, computed on write and again on read
        value = reference()
        for _ in range(2):
            hashlib.blake2b(payload, key=digest, digest_size=16).digest()
        return value

    arms = {"clear": lambda: reference(), "blake2b": blake2b}
    for cipher, (_, size) in CIPHERS.items():
        sealer = Sealer({"k": os.urandom(size)}, "k", cipher)
        arms[cipher] = lambda sealer=sealer: sealer.open(sealer.seal(reference(), name), name)
    times: dict[str, list[float]] = {a: [] for a in arms}
    for _ in tqdm(range(pages), desc="pages", unit="page"):
        for arm, fn in arms.items():  # alternating: every arm sees the same machine state
            t0 = time.perf_counter()
            fn()
            times[arm].append(time.perf_counter() - t0)
    out = {}
    for arm, ts in times.items():
        med = statistics.median(ts)
        out[arm] = {"median_s": med, "mb_s": len(payload) / med / 1e6, "us_per_token": med / PAGE_TOKENS * 1e6}
    for arm in (*CIPHERS, "blake2b"):
        out[arm]["ratio_to_clear"] = out[arm]["median_s"] / out["clear"]["median_s"]
    return out


def resume_arm(sealed: bool, prompts: int, folder: Path, rep: int) -> dict:
    env = dict(os.environ)
    env.pop("SLUICE_REDIS_ENCRYPTION_KEYS_FILE", None)
    if sealed:
        keys = folder / "keys.toml"
        keys.write_text(f'active = "k1"\n[keys]\nk1 = "{base64.b64encode(os.urandom(32)).decode()}"\n')
        env["SLUICE_REDIS_ENCRYPTION_KEYS_FILE"] = str(keys)
    out = folder / f"resume-{'sealed' if sealed else 'clear'}-{rep}.json"
    subprocess.run([sys.executable, str(OUT / "resume.py"), "--prompts", str(prompts), "--out", str(out)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert result["sealed"] == sealed, "the arm did not run as configured"
    assert all(r["same_text"] for r in result["rows"]), "resumed text differs from recompute"
    return result


def main(args) -> None:
    pages = per_page(args.pages)
    resume: dict[str, list[float]] = {"clear": [], "sealed": []}
    loaded: dict[str, list[int]] = {"clear": [], "sealed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in tqdm(range(args.resume_reps), desc="resume reps", unit="rep"):
            order = (False, True) if rep % 2 == 0 else (True, False)
            for sealed in order:
                r = resume_arm(sealed, args.prompts, Path(tmp), rep)
                arm = "sealed" if sealed else "clear"
                resume[arm].append(r["median_pages_s"])
                loaded[arm].append(sum(row["loaded_tokens"] for row in r["rows"]))
    print(f"\n{common.machine()}; {common.today()}; rev {common.git_rev()}")
    print(f"per page ({PAGE_TOKENS} tokens x {BYTES_PER_TOKEN} B, {args.pages} pages, alternating):")
    for arm, row in pages.items():
        ratio = f", x{row['ratio_to_clear']:.2f} of clear" if "ratio_to_clear" in row else " (reference)"
        print(f"  {arm:12s} {row['mb_s']:8.0f} MB/s  {row['us_per_token']:7.1f} us per token{ratio}")
    med = {arm: statistics.median(v) for arm, v in resume.items() if v}
    if len(med) == 2:
        print(f"resume with pages, median pick-up to first token over {args.resume_reps} reps x {args.prompts} "
              f"prompts: clear {med['clear']:.3f} s, sealed {med['sealed']:.3f} s, ratio {med['sealed'] / med['clear']:.3f}"
              f" (runs: clear {[round(x, 3) for x in resume['clear']]}, sealed {[round(x, 3) for x in resume['sealed']]})")
        assert loaded["sealed"] == loaded["clear"], f"arms loaded different page counts: {loaded}"
    (OUT / "sealing.json").write_text(json.dumps({
        "args": vars(args), "per_page": pages, "resume_runs": resume, "resume_loaded_tokens": loaded,
        "machine": common.machine(), "date": common.today(), "rev": common.git_rev()}, indent=2))
    print(f"wrote {OUT / 'sealing.json'}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=200)
    p.add_argument("--resume-reps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    main(p.parse_args())
