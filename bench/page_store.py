"""What storing one KV page costs the Redis Cluster, split by node role (primaries vs replicas).

    python bench/page_store.py [--pages 60] [--rate 3] [--page-tokens 128] [--bytes-per-token 46080]

Writes `--pages` pages of the compare workload's size (SmolLM2 float32: 128 tokens x 46,080 bytes,
5.9 MB) through the KV connector's own Redis client and value encoding, `--rate` pages per second
(about the compare run's request rate: one page per request), each with a 60 s TTL. Reads the CPU
time of every node of the dev stack's Redis Cluster (`sluice dev up`, by pid file) before and
after, and each node's role from `INFO replication`, and prints the CPU per page of the primaries,
the replicas, and the writing thread: encoding the value (check and copy) and the SET (packing,
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
from bench import common  # noqa: E402
from worker import devstack, kv_pages  # noqa: E402
from worker.kv_connector import _Redis  # noqa: E402  the connector's client, so the path is the same

OUT = Path(__file__).resolve().parent


def nodes(state: Path) -> dict[int, psutil.Process]:
    """port -> process of each Redis node `sluice dev up` started."""
    out = {}
    for pidfile in sorted(state.glob("redis-*.pid")):
        out[int(pidfile.stem.split("-")[1])] = psutil.Process(int(pidfile.read_text().strip()))
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


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def main(args) -> None:
    s = common.settings()
    procs = nodes(devstack.DEFAULT_DIR)
    role = roles(procs)
    client = _Redis(s.redis.client_url(), s.redis.timeout_ms / 1000, 5.0, s.redis.client_options())
    payload = os.urandom(args.page_tokens * args.bytes_per_token)
    layers = 30
    shape = (2, args.page_tokens, args.bytes_per_token // (2 * layers * 4))
    before = {port: cpu(p) for port, p in procs.items()}
    t0 = time.monotonic()
    stored, encode_s, send_s = 0, 0.0, 0.0
    for i in tqdm(range(args.pages), desc="pages", unit="page"):
        digest = os.urandom(32)
        c0 = time.thread_time()  # CPU of this thread only, kernel time of its syscalls included
        value = kv_pages.encode_parts(digest, "float32", shape, layers, [payload])
        c1 = time.thread_time()
        ok = client.pipeline_run([("set", kv_pages.key("bench-page-store", digest), value, 60)]) is not None
        c2 = time.thread_time()
        encode_s, send_s, stored = encode_s + c1 - c0, send_s + c2 - c1, stored + ok
        wait = t0 + (i + 1) / args.rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    time.sleep(1)  # the replicas apply what their primaries sent
    span = time.monotonic() - t0
    used = {port: cpu(p) - before[port] for port, p in procs.items()}
    if stored != args.pages:
        raise SystemExit(f"only {stored} of {args.pages} pages were stored")
    per_page = {r: 1000 * sum(v for port, v in used.items() if role[port] == r) / stored
                for r in ("primary", "replica")}
    per_page["writer: encode (check, copy)"] = 1000 * encode_s / stored
    per_page["writer: SET (pack, send, reply)"] = 1000 * send_s / stored
    mb = len(value) / 1e6
    print(f"\n{stored} pages of {mb:.1f} MB at {args.rate}/s over {span:.0f} s; {common.machine()}; "
          f"{common.today()}; rev {common.git_rev()}")
    for name, ms in per_page.items():
        print(f"  {name:32s} {ms:7.1f} ms CPU per page")
    (OUT / "page_store.json").write_text(json.dumps({
        "args": vars(args), "page_mb": mb, "cpu_ms_per_page": per_page,
        "nodes": {str(port): {"role": role[port], "cpu_s": used[port]} for port in procs},
        "machine": common.machine(), "date": common.today(), "rev": common.git_rev()}, indent=2))
    print(f"wrote {OUT / 'page_store.json'}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=60)
    p.add_argument("--rate", type=float, default=3.0, help="pages per second")
    p.add_argument("--page-tokens", type=int, default=128)
    p.add_argument("--bytes-per-token", type=int, default=46_080)
    main(p.parse_args())
