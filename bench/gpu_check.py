"""KV page movement on a CUDA device: copy bandwidth of sluice's page mover against the machine's own.

    python bench/gpu_check.py --out DIR

Pure torch (no vLLM, no network). Reference, measured in the same run: plain pinned-memory copies
of the same number of bytes, device to host and host to device. sluice's arms: `PageMover.save`
(gather blocks from every layer, copy to pinned host memory on a side stream, wait) and
`PageMover.load` (bytes staged in pinned memory, copied in, scattered into blocks). Prints GB/s
and the ratios, and writes `gpu_check.json` to DIR.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from worker.kv_move import PageMover  # noqa: E402


def timed(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d"), "cases": []}
    # (name, layers, one layer's KV shape, dtype, pages moved): a Llama-8B-like GQA cache (32 layers,
    # 8 KV heads x 128, block 16) and a DeepSeek-V2-like MLA latent cache (27 layers, 576 per token).
    cases = [("gqa_8b_bf16", 32, (2048, 2, 16, 8, 128), torch.bfloat16, 256),
             ("mla_latent_bf16", 27, (2048, 16, 576), torch.bfloat16, 256)]
    for name, n_layers, shape, dtype, n_pages in cases:
        layers = [torch.randn(shape, device="cuda").to(dtype) for _ in range(n_layers)]
        mover = PageMover(layers, shape[0])
        blocks = list(range(0, 2 * n_pages, 2))  # every other block: a gather, not one slice
        nbytes = mover.page_bytes * n_pages
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d2h = timed(lambda: pinned.copy_(dev, non_blocking=True), args.repeat)
        h2d = timed(lambda: dev.copy_(pinned, non_blocking=True), args.repeat)
        save = timed(lambda: mover.save(blocks).wait(), args.repeat)
        pending = mover.save(blocks)
        payloads = [pending.page_bytes(i) for i in range(n_pages)]
        staged = mover.host_pages(payloads)
        load = timed(lambda: mover.load(blocks, staged), args.repeat)
        check = mover.save(blocks).wait()
        assert torch.equal(check, staged), "pages changed on the way through"
        row = {"case": name, "pages": n_pages, "bytes": nbytes, "page_bytes": mover.page_bytes,
               "d2h_GBps": nbytes / d2h / 1e9, "h2d_GBps": nbytes / h2d / 1e9,
               "save_GBps": nbytes / save / 1e9, "load_GBps": nbytes / load / 1e9}
        row["save_vs_d2h"] = row["save_GBps"] / row["d2h_GBps"]
        row["load_vs_h2d"] = row["load_GBps"] / row["h2d_GBps"]
        results["cases"].append(row)
        print(f"{name}: {n_pages} pages x {mover.page_bytes / 1e6:.2f} MB; plain pinned copy d2h "
              f"{row['d2h_GBps']:.1f} GB/s, h2d {row['h2d_GBps']:.1f} GB/s; sluice save {row['save_GBps']:.1f} GB/s "
              f"({row['save_vs_d2h']:.2f}x), load {row['load_GBps']:.1f} GB/s ({row['load_vs_h2d']:.2f}x)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / 'gpu_check.json'}; {results['device']}, torch {results['torch']}, {results['date']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
