"""Page movement between a paged KV cache and host bytes, on CPU here and on CUDA where a device is present.

Pure torch (no vLLM): the same functions the connector calls, on tensors shaped like each known layout.
"""

import pytest
import torch

from worker.kv_move import LAYOUTS, LayoutError, PageMover, detect

BLOCKS, LAYERS = 12, 3
# (layout, one layer's KV shape for BLOCKS blocks): GQA with K/V inside the block, K/V split first,
# and an MLA latent (kv_lora_rank 512 + rope 64) per token.
SHAPES = {
    "blocks_first": (BLOCKS, 2, 16, 2, 64),
    "kv_split_first": (2, BLOCKS, 16, 2, 64),
    "mla_latent": (BLOCKS, 16, 576),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def cache(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(LAYERS)]


def roundtrip(device: str, shape, dtype):
    """Save blocks from one cache, turn them into bytes, load them into other blocks of a fresh cache."""
    src = cache(shape, dtype, device, seed=1)
    mover = PageMover(src, BLOCKS)
    blocks = [7, 2, 9]
    pending = mover.save(blocks)
    host = pending.wait()
    assert host.device.type == "cpu" and host.shape == (3, LAYERS, *mover.page_shape)
    payloads = [pending.page_bytes(i) for i in range(len(blocks))]
    assert all(len(p) == mover.page_bytes for p in payloads)
    # the pieces the writer stores are the stacked page's bytes, in the same order
    assert payloads == [host[i].contiguous().view(torch.uint8).numpy().tobytes() for i in range(len(blocks))]

    dst = [torch.zeros_like(kv) for kv in cache(shape, dtype, device, seed=2)]
    loader = PageMover(dst, BLOCKS)
    targets = [0, 5, 11]
    loader.load(targets, loader.host_pages(payloads))
    for s, d in zip(src, dst):
        for b_src, b_dst in zip(blocks, targets):
            sel = (slice(None), b_src) if mover.layout.block_dim else (b_src,)
            out = (slice(None), b_dst) if mover.layout.block_dim else (b_dst,)
            assert torch.equal(s[sel], d[out])
        untouched = [b for b in range(BLOCKS) if b not in targets]
        idx = torch.tensor(untouched, device=d.device)
        assert not d.index_select(mover.layout.block_dim, idx).any()  # nothing else was written
    return mover, pending


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_pages_round_trip_on_cpu(name, dtype):
    mover, _ = roundtrip("cpu", SHAPES[name], dtype)
    assert mover.layout.name == ("kv_split_first" if name == "kv_split_first" else "blocks_first")


def test_unknown_layout_is_refused_with_the_shape():
    with pytest.raises(LayoutError, match=r"\(4, 7, 16\).*12 blocks"):
        detect(torch.zeros(4, 7, 16), BLOCKS)
    with pytest.raises(LayoutError, match="layers differ"):
        PageMover([torch.zeros(BLOCKS, 4), torch.zeros(BLOCKS, 5)], BLOCKS)


def test_every_layout_is_described():
    assert {layout.name for layout in LAYOUTS} == {"blocks_first", "kv_split_first"}
    assert all(layout.about for layout in LAYOUTS)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_pages_round_trip_on_cuda(name, dtype):
    mover, pending = roundtrip("cuda", SHAPES[name], dtype)
    assert pending.host.is_pinned() and pending.event is not None  # async copy to pinned memory


@pytest.mark.gpu
@needs_cuda
def test_saving_does_not_block_the_forward_stream():
    """A save queued behind a long kernel returns at once; the bytes are there after `wait`."""
    kv = cache((256, 2, 16, 8, 128), torch.bfloat16, "cuda", seed=3)
    mover = PageMover(kv, 256)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(20):
        a = a @ a  # keep the current stream busy for a while
        a = a / a.norm()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    pending = mover.save(list(range(0, 256, 2)))
    assert not pending.event.query(), "the copy finished before the work it must follow"
    host = pending.wait()
    torch.cuda.synchronize()
    assert torch.equal(host[:, 0].to("cuda"), kv[0][0:256:2])
