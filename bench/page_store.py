"""What storing one KV page costs the Redis Cluster, split by node role (primaries vs replicas).

    python bench/page_store.py [--pages 120] [--rounds 3] [--rate 3] [--page-tokens 128] [--bytes-per-token 46080]

Writes `--pages` pages of the compare workload's size (SmolLM2 float32: 128 tokens x 46,080 bytes,
5.9 MB) through the KV connector's own Redis client and value encoding, `--rate` pages per second
(about the compare run's request rate: one page per request), each with a 60 s TTL, two ways in
alternating blocks: `joined` (the value built whole and packed by redis-py, as sealed pages still
are) and `pieces` (header and payload sent as they lie in memory, as pages in clear are). Reads
the CPU time of every node of the dev stack's Redis Cluster (`sluice dev up`, by pid file) around
each block, and each node's role from `INFO replication`, and prints per page and way the CPU of
the primaries, the replicas, and the writing thread: encoding (check, copy) and the SET (packing,
sending on loopback, reading the reply; the kernel's share of loopback TCP is charged here). Writes bench/page_store.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import common, harness  # noqa: E402
from worker import devstack, kv_pages  # noqa: E402
from worker.kv_connector import _Redis  # noqa: E402  the connector's client, so the path is the same

OUT = Path(__file__).resolve().parent


def nodes(state: Path) -> dict[int, psutil.Process]:
    """port -> process of each Redis node `sluice dev up` started."""
    out = {int(stem.split("-")[1]): p for stem, p in harness.dev_stack_processes("redis-*.pid", state).items()}
    if not out:
        raise SystemExit(f"no Redis node pid files under {state}: run `sluice dev up` first")
    return out


def roles(ports) -> dict[int, str]:
    import redis

    out = {}
    for port in ports:
        client = redis.Redis(host="127.0.0.1", port=port)
        out[port] = "primary" if client.info("replication")["role"] == "master" else "replica"
        client.close()
    return out


def write(client, mode: str, payload: bytes, shape, layers: int, pages: int, rate: float, bar) -> tuple:
    """`pages` pages one way; (pages stored, encode CPU s, SET CPU s) of this thread."""
    stored, encode_s, send_s = 0, 0.0, 0.0
    t0 = time.monotonic()
    for i in range(pages):
        digest = os.urandom(32)
        key = kv_pages.key("bench-page-store", digest)
        c0 = time.thread_time()  # CPU of this thread only, kernel time of its syscalls included
        if mode == "pieces":  # what the connector does for pages in clear
            value = kv_pages.encode_pieces(digest, "float32", shape, layers, [payload])
            c1 = time.thread_time()
            ok = client.set_pieces([(key, value)], 60) is not None
        else:  # one value, packed whole: what it did before (and still does for sealed pages)
            value = kv_pages.encode_parts(digest, "float32", shape, layers, [payload])
            c1 = time.thread_time()
            ok = client.pipeline_run([("set", key, value, 60)]) is not None
        c2 = time.thread_time()
        encode_s, send_s, stored = encode_s + c1 - c0, send_s + c2 - c1, stored + ok
        bar.update(1)
        wait = t0 + (i + 1) / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    time.sleep(1)  # the replicas apply what their primaries sent
    return stored, encode_s, send_s


def main(args) -> None:
    s = common.settings()
    procs = nodes(devstack.DEFAULT_DIR)
    role = roles(procs)
    client = _Redis(s.redis.client_url(), s.redis.timeout_ms / 1000, 5.0, s.redis.client_options())
    payload = os.urandom(args.page_tokens * args.bytes_per_token)
    layers = 30
    shape = (2, args.page_tokens, args.bytes_per_token // (2 * layers * 4))
    modes = ("joined", "pieces")
    totals = {m: {"pages": 0, "primary": 0.0, "replica": 0.0, "encode": 0.0, "send": 0.0} for m in modes}
    block = max(1, args.pages // (2 * args.rounds))
    with tqdm(total=block * 2 * args.rounds, desc="pages", unit="page") as bar:
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):  # alternating blocks
                before = {port: harness.process_cpu_seconds(p) for port, p in procs.items()}
                stored, encode_s, send_s = write(client, mode, payload, shape, layers, block, args.rate, bar)
                if stored != block:
                    raise SystemExit(f"{mode}: only {stored} of {block} pages were stored")
                t = totals[mode]
                for port, p in procs.items():
                    t[role[port]] += harness.process_cpu_seconds(p) - before[port]
                t["pages"] += stored
                t["encode"] += encode_s
                t["send"] += send_s
    per_page = {m: {k: 1000 * v / t["pages"] for k, v in t.items() if k != "pages"} for m, t in totals.items()}
    mb = args.page_tokens * args.bytes_per_token / 1e6
    print(f"\n{block * 2 * args.rounds} pages of {mb:.1f} MB at {args.rate}/s, {args.rounds} alternating rounds; "
          f"{common.machine()}; {common.today()}; rev {common.git_rev()}")
    print("CPU ms per page        " + "".join(f"{m:>10s}" for m in modes))
    names = {"primary": "Redis primary", "replica": "Redis replica", "encode": "writer: encode",
             "send": "writer: SET"}
    for k, name in names.items():
        print(f"  {name:20s} " + "".join(f"{per_page[m][k]:10.1f}" for m in modes))
    writer = {m: per_page[m]["encode"] + per_page[m]["send"] for m in modes}
    print(f"  {'writer, total':20s} " + "".join(f"{writer[m]:10.1f}" for m in modes)
          + f"   pieces/joined {writer['pieces'] / writer['joined']:.2f}")
    (OUT / "page_store.json").write_text(json.dumps({
        "args": vars(args), "page_mb": mb, "cpu_ms_per_page": per_page,
        "machine": common.machine(), "date": common.today(), "rev": common.git_rev()}, indent=2))
    print(f"wrote {OUT / 'page_store.json'}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=120)
    p.add_argument("--rate", type=float, default=3.0, help="pages per second")
    p.add_argument("--rounds", type=int, default=3, help="alternating blocks of each mode")
    p.add_argument("--page-tokens", type=int, default=128)
    p.add_argument("--bytes-per-token", type=int, default=46_080)
    main(p.parse_args())
