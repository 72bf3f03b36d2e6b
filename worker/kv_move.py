"""Moving KV pages between a paged KV cache (CPU, CUDA or NPU tensors) and host bytes. Pure torch.

The KV connector's only contact with device memory. Saving: the blocks of a page are
gathered from every layer on the device (on the stream that wrote them), copied to
pinned host memory with a non-blocking copy on a side stream, and an event marks
when the bytes are there, so the forward pass never waits for the copy; the writer
thread waits on the event instead. Loading: pages arrive as host bytes, are staged
in pinned memory, copied to the device without blocking the host, and scattered
into their blocks on the current stream, ahead of the forward pass that reads them.
No call here touches a device tensor through host-only APIs (`.numpy()`).

Layouts. A page is one block of one layer; how a layer's KV tensor holds its blocks
depends on the attention backend. The layouts sluice knows are listed in `LAYOUTS`,
the one place that describes them; `detect` picks one from the tensor and the block
count vLLM reports, and refuses anything else with an error naming the shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LayoutError(ValueError):
    """A KV cache tensor whose layout sluice does not know how to page."""


@dataclass(frozen=True)
class Layout:
    name: str
    block_dim: int  # the dimension of a layer's KV tensor that indexes blocks
    about: str

    def page_shape(self, kv: torch.Tensor) -> tuple[int, ...]:
        """The shape of one block's page of this layer (the tensor's shape without the block dim)."""
        return tuple(s for d, s in enumerate(kv.shape) if d != self.block_dim)


LAYOUTS = (
    # vLLM 0.32 hands every backend a per-layer view whose logical order starts with the
    # block (KVCacheLayout: [L, B, ...] or [B, L, ...] physically, [B, ...] per layer): the
    # CPU backend, FlashAttention, FlashInfer and Triton (K/V and heads inside the block),
    # and MLA backends (the compressed latent plus rope part, [B, N, kv_lora_rank + rope]).
    Layout("blocks_first", 0, "[blocks, ...]: vLLM 0.32 per-layer views (CPU, FlashAttention, FlashInfer, "
                              "Triton, MLA latent)"),
    # Older FlashAttention/FlashInfer caches and some plugins split K and V outermost.
    Layout("kv_split_first", 1, "[2 (K, V), blocks, ...]: K/V-split caches (older FlashAttention, plugins)"),
)


def detect(kv: torch.Tensor, num_blocks: int) -> Layout:
    """The layout of a layer's KV tensor, given how many blocks vLLM allocated."""
    if kv.dim() >= 2 and kv.shape[0] == num_blocks:
        return LAYOUTS[0]
    if kv.dim() >= 3 and kv.shape[0] == 2 and kv.shape[1] == num_blocks:
        return LAYOUTS[1]
    known = "; ".join(f"{layout.name} {layout.about}" for layout in LAYOUTS)
    raise LayoutError(f"KV cache of shape {tuple(kv.shape)} ({kv.dtype}) with {num_blocks} blocks matches no "
                      f"known layout ({known}); KV pages cannot be saved or loaded for this backend")


def _side_stream(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    if device.type == "npu":  # torch_npu mirrors torch.cuda's stream API
        return torch.npu.Stream(device=device)  # type: ignore[attr-defined]
    return None


def _current_stream(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    if device.type == "npu":
        return torch.npu.current_stream(device)  # type: ignore[attr-defined]
    return None


def _stream_context(stream):
    if stream is None:
        import contextlib

        return contextlib.nullcontext()
    return torch.cuda.stream(stream) if stream.device.type == "cuda" else torch.npu.stream(stream)  # type: ignore[attr-defined]


def _index(blocks: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on the device; through pinned memory, so the host never waits for the stream."""
    ids = torch.tensor(blocks, dtype=torch.long)
    if device.type == "cpu":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


def _pinned(shape, dtype, device: torch.device) -> torch.Tensor:
    """Host memory the device can copy to and from without a bounce (plain memory on CPU)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type in ("cuda", "npu"))


class HostPages:
    """Pages on their way to host memory: `wait()` returns them once the copy has landed.

    On CPU the gathered pages already are host memory, one tensor per layer: they are not stacked
    on the engine's thread; `page_parts` hands the writer each layer's piece of a page instead.
    """

    def __init__(self, host: torch.Tensor | None, event, per_layer: list[torch.Tensor] | None = None):
        self.host, self.event, self.per_layer = host, event, per_layer

    def wait(self) -> torch.Tensor:
        """[n, layers, *page] once the copy has landed (on CPU, stacked now: tests and tools only)."""
        if self.event is not None:
            self.event.synchronize()  # blocks only the caller (the writer thread), never the device
        if self.host is None:
            self.host = torch.stack(self.per_layer, dim=1)
        return self.host

    def page_parts(self, i: int) -> list[memoryview]:
        """Page i (all layers) as layer-major byte pieces, without a copy; waits for the device copy."""
        if self.per_layer is not None:
            return [_byte_view(layer[i]) for layer in self.per_layer]
        return [_byte_view(self.wait()[i])]

    def page_bytes(self, i: int) -> bytes:
        """Page i (all layers) as raw bytes, layer-major."""
        return b"".join(self.page_parts(i))


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class PageMover:
    """Gathers, copies and scatters the pages of one engine's layers (all of one layout, dtype, device)."""

    def __init__(self, layers: list[torch.Tensor], num_blocks: int):
        if not layers:
            raise LayoutError("no KV cache layers")
        self.layout = detect(layers[0], num_blocks)
        first = layers[0]
        for kv in layers[1:]:
            if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
                raise LayoutError(f"layers differ: {tuple(first.shape)} {first.dtype} {first.device} vs "
                                  f"{tuple(kv.shape)} {kv.dtype} {kv.device}")
        self.layers = layers
        self.device = first.device
        self.dtype = first.dtype
        self.page_shape = self.layout.page_shape(first)
        self._side = _side_stream(self.device)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across every layer."""
        n = len(self.layers) * self.dtype.itemsize
        for s in self.page_shape:
            n *= s
        return n

    def gather_layer(self, kv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """This layer's pages of the blocks in `index` as a new device tensor [n, *page] (a device-side
        copy, queued on the current stream: the blocks may be reused once the request finishes)."""
        pages = kv.index_select(self.layout.block_dim, index)
        return pages.movedim(self.layout.block_dim, 0).contiguous() if self.layout.block_dim else pages

    def to_host(self, per_layer: list[torch.Tensor]) -> HostPages:
        """[n, *page] device tensors, one per layer, to host memory as [n, layers, *page].

        The stacking and the device-to-host copy run on a side stream that first waits for
        the current one (which wrote the pages); the copy does not block the host or the
        forward pass. The returned `HostPages.wait()` is the only synchronisation.
        """
        if self._side is None:  # CPU: the gathered pages already are host memory
            return HostPages(None, None, per_layer)
        current = _current_stream(self.device)
        with _stream_context(self._side):
            self._side.wait_stream(current)
            stacked = torch.stack(per_layer, dim=1)
            host = _pinned(stacked.shape, stacked.dtype, self.device)
            host.copy_(stacked, non_blocking=True)
            for t in per_layer:
                t.record_stream(self._side)  # keep the gathered pages alive until the copy is done
            event = torch.cuda.Event() if self.device.type == "cuda" else torch.npu.Event()  # type: ignore[attr-defined]
            event.record(self._side)
        return HostPages(host, event)

    def save(self, blocks: list[int]) -> HostPages:
        """Gather `blocks` from every layer and start their copy to the host."""
        index = _index(blocks, self.device)
        return self.to_host([self.gather_layer(kv, index) for kv in self.layers])

    def index(self, blocks: list[int]) -> torch.Tensor:
        """Block ids for `gather_layer`, on this engine's device."""
        return _index(blocks, self.device)

    def host_pages(self, payloads: list[bytes]) -> torch.Tensor:
        """Page payloads (as `HostPages.page_bytes` wrote them) in one host tensor [n, layers, *page]."""
        host = _pinned((len(payloads), len(self.layers), *self.page_shape), self.dtype, self.device)
        flat = host.view(len(payloads), -1).view(torch.uint8)
        for i, payload in enumerate(payloads):
            flat[i].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return host

    def load(self, blocks: list[int], host: torch.Tensor) -> None:
        """Copy host pages [n, layers, *page] into `blocks` of every layer.

        Queued on the current stream (host to device without blocking the host, then one
        indexed copy per layer), so the forward pass that follows on that stream sees them.
        """
        if len(blocks) != host.shape[0]:
            raise ValueError(f"{len(blocks)} blocks for {host.shape[0]} pages")
        staged = host.to(self.device, non_blocking=self.device.type != "cpu")
        index = _index(blocks, self.device)
        dim = self.layout.block_dim
        for li, kv in enumerate(self.layers):
            pages = staged[:, li]
            kv.index_copy_(dim, index, pages.movedim(0, dim) if dim else pages)
