"""A vLLM KV connector that keeps full KV pages in Redis Cluster.

Registered through `kv_transfer_config` (see `worker.engine`); vLLM builds one
instance in the scheduler process and one in each model-runner process.

Scheduler side: for a request that sluice marked (`kv_transfer_params` with its
tenant), find how many leading pages beyond the local prefix cache exist in
Redis (one pipelined EXISTS), ask vLLM to allocate blocks for them, and each
step tell the model runner which pages to load and which newly completed pages
(prompt and decode) to save.

Model-runner side: loads are fetched with one pipelined GET, checked (layout,
CRC-32 over key and bytes) and copied into the paged cache before the forward
pass; a page that is missing or fails a check is reported through
`get_block_ids_with_load_errors`, and vLLM (policy `recompute`) computes it
instead. Saves copy each completed page out of every layer after the forward
pass and hand it to a writer thread (pipelined SET with TTL), so Redis latency
never stalls a step; if the writer falls behind, pages are dropped and counted.
With `kv.save_budget_mib_s` set, the scheduler side plans saves only within that byte
budget (`worker/save_budget.py`): a page the budget cannot pay for waits while its request
runs and is saved, in order, when the budget allows, the requests with the most tokens still to
generate first; pages still waiting when the request finishes are not saved, counted as
`save_over_budget`.
Every touch of device memory goes through `worker/kv_move.py` (gather on the device,
copy to pinned host memory on a side stream, load by an indexed copy), so the same
code serves CPU, CUDA and NPU caches of any layout listed there.

Redis trouble is never fatal: after an error the connector stops talking to
Redis for `retry_s` (lookups miss, saves are dropped) and then tries again.
Counts travel back to sluice in the finished request's `kv_transfer_params`.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from worker import kv_pages, sealing
from worker.kv_move import PageMover
from worker.redis_client import retry_once
from worker.redis_seeds import SeedNodes
from worker.save_budget import SaveBudget, save_order
from worker.settings import KvSettings, RedisSettings

PARAMS_KEY = "sluice"  # inside kv_transfer_params
# Pages are megabytes: reading them in 1 MiB chunks instead of redis-py's 64 KiB cuts a load round by a third.
PAGE_READ_SIZE = 1 << 20


class _Redis:
    """A redis-py cluster client that backs off after an error instead of failing the engine."""

    def __init__(self, url: str, timeout_s: float, retry_s: float, client_options: dict | None = None):
        self.url, self.timeout_s, self.retry_s = url, timeout_s, retry_s
        self.client_options = client_options or {}
        self.seeds = SeedNodes(url)
        self._client = None
        self._down_until = 0.0

    def client(self):
        if time.monotonic() < self._down_until:
            return None
        if self._client is None:
            from redis.cluster import ClusterNode, RedisCluster

            try:
                self._client = RedisCluster.from_url(
                    self.seeds.url, startup_nodes=self.seeds.startup_nodes(ClusterNode),
                    socket_timeout=self.timeout_s, retry=retry_once(asynchronous=False), socket_connect_timeout=self.timeout_s,
                    socket_read_size=PAGE_READ_SIZE, **self.client_options)
                self.seeds.remember(self._client.get_nodes())
            except Exception:
                self.failed()
                return None
        return self._client

    def failed(self) -> None:
        self._down_until = time.monotonic() + self.retry_s
        client, self._client = self._client, None
        if client is not None:
            try:
                self.seeds.remember(client.get_nodes())
                client.close()
            except Exception:
                pass

    def set_pieces(self, items, ttl_s: int) -> list[float] | None:
        """SET each `(key, pieces)` to the pieces joined, sent to the key's primary as they lie in
        memory: no copy of a value is made to send it (pages are megabytes, and each copy is taken
        from the engine's cores). A refusal (a moved slot) goes again through redis-py's pipeline,
        which follows it. Returns when each SET was acknowledged (`time.perf_counter()`, in order:
        one at a time, so the leading pages are stored first); None if Redis is unavailable."""
        from redis.exceptions import ResponseError

        client = self.client()
        if client is None:
            return None
        acknowledged = []
        try:
            for key, pieces in items:
                pool = client.get_redis_connection(client.get_node_from_key(key)).connection_pool
                conn = pool.get_connection()
                try:
                    conn.send_packed_command(kv_pages.set_command(key.encode(), pieces, ttl_s), check_health=False)
                    conn.read_response()
                except ResponseError:
                    refused = True
                else:
                    refused = False
                finally:
                    pool.release(conn)
                if refused and self.pipeline_run([("set", key, b"".join(pieces), ttl_s)]) is None:
                    return None
                acknowledged.append(time.perf_counter())
            return acknowledged
        except Exception:
            self.failed()
            return None

    def pipeline_run(self, commands) -> list | None:
        """[(method, args...)] in one cluster pipeline; None if Redis is unavailable."""
        client = self.client()
        if client is None:
            return None
        try:
            pipe = client.pipeline(transaction=False)
            for method, *args in commands:
                getattr(pipe, method)(*args)
            return pipe.execute(raise_on_error=True)
        except Exception:
            self.failed()
            return None


@dataclass
class _Transfer:
    req_id: str
    pages: list[tuple[bytes, int]]  # (page digest, block id)


@dataclass
class SluiceKVMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class SluiceKVWorkerMetadata(KVConnectorWorkerMetadata):
    counts: dict[str, int] = field(default_factory=dict)
    loaded_pages: dict[str, int] = field(default_factory=dict)  # req id -> leading pages loaded intact

    def aggregate(self, other: "SluiceKVWorkerMetadata") -> "SluiceKVWorkerMetadata":
        counts = dict(self.counts)
        for k, v in other.counts.items():
            counts[k] = counts.get(k, 0) + v
        loaded = dict(self.loaded_pages)
        for k, v in other.loaded_pages.items():
            loaded[k] = min(v, loaded.get(k, v))
        return SluiceKVWorkerMetadata(counts, loaded)


@dataclass
class _ReqState:
    request: Any
    seed: bytes
    save: bool
    blocks: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    saved_pages: int = 0  # leading pages known to be in Redis
    full_pages: int = 0  # pages completed so far: those past saved_pages wait for the save budget
    load_from: int = 0  # pages [load_from, load_to) come from Redis
    load_to: int = 0
    loaded_pages: int | None = None


def _tokens_to_go(request) -> int:
    return max(0, request.max_tokens - request.num_output_tokens)


def _layer_order(name: str):
    m = re.search(r"\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


class SluiceKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        redis = msgspec.convert(extra.get("redis", {}), RedisSettings)
        kv = msgspec.convert(extra.get("kv", {}), KvSettings)
        self.block_size = vllm_config.cache_config.block_size
        self.prefix = redis.key_prefix
        self.fingerprint = extra.get("fingerprint", "")
        self.ttl_s = kv.ttl_s
        # credentials and TLS from the same settings as the worker's (with `password_file` the file is read
        # here, in the engine's process, and the password never travels in the engine's configuration)
        self.redis = _Redis(redis.client_url(), redis.timeout_ms / 1000, float(extra.get("retry_s", 5.0)), redis.client_options())
        # pages sealed under the operator's keys: a page forged or altered in Redis is a miss (recomputed)
        self.sealer = sealing.load(redis.encryption_keys_file)
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._pending_counts: dict[str, int] = {}
        self._budget = self._save_budget(kv, role, kv_cache_config)
        # model-runner side
        self._load_errors: set[int] = set()
        self._counts: dict[str, int] = {}
        self._loaded: dict[str, int] = {}
        self._lock = threading.Lock()
        self._mover: PageMover | None = None  # built from the engine's KV caches (worker/kv_move.py)
        self._layer_names: list[str] = []
        self._save_buf: dict[str, torch.Tensor] = {}  # layer -> this step's pages, gathered on the device
        self._save_index: torch.Tensor | None = None
        self._writer: queue.Queue | None = None
        self._max_queue = int(extra.get("max_queued_pages", 4096))

    # -- helpers ---------------------------------------------------------------

    @staticmethod
    def _save_budget(kv: KvSettings, role: KVConnectorRole, kv_cache_config) -> SaveBudget | None:
        """The scheduler's byte budget for saves, priced by the engine's own page size (all layers of a block)."""
        if role != KVConnectorRole.SCHEDULER or kv.save_budget_mib_s == 0:
            return None
        if kv_cache_config is None:
            raise RuntimeError("kv.save_budget_mib_s is set but vLLM gave the connector no KV cache configuration "
                               "to price pages by")
        page_bytes = sum(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in kv_cache_config.kv_cache_groups)
        return SaveBudget.from_settings(kv.save_budget_mib_s, page_bytes, kv.save_burst_s)

    def _count_pending(self, name: str, n: int) -> None:
        self._pending_counts[name] = self._pending_counts.get(name, 0) + n

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:  # the writer thread counts too
            self._counts[name] = self._counts.get(name, 0) + n

    def _count_time(self, op: str, part: str, seconds: float) -> None:
        """Time spent moving pages, as whole microseconds (counts are integers): sluice_kv_seconds_total."""
        self._count(f"us_{op}_{part}", round(seconds * 1e6))

    def _key(self, digest: bytes) -> str:
        return kv_pages.key(self.prefix, digest)

    def _open(self, digest: bytes, value: bytes | None) -> bytes | None:
        if self.sealer is None or value is None:
            return value
        try:
            return self.sealer.open(value, self._key(digest))
        except sealing.Unsealable as exc:
            raise kv_pages.PageError(exc.reason) from None

    # -- scheduler side --------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if params is None:
            return 0, False
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(
                request, kv_pages.root(self.fingerprint, str(params.get("tenant", "default"))), bool(params.get("save")))
        tokens = request.all_token_ids
        # vLLM must compute at least the last token itself
        full = (len(tokens) - 1) // self.block_size
        st.digests = kv_pages.chain(st.seed, tokens, self.block_size, full)
        start = num_computed_tokens // self.block_size
        if not params.get("lookup", True) or full <= start:
            return 0, False
        found = self.redis.pipeline_run([("exists", self._key(d)) for d in st.digests[start:]])
        if found is None:
            self._count_pending("lookup_unavailable", 1)
            return 0, False
        hit = start
        for ok in found:
            if not ok:
                break
            hit += 1
        st.saved_pages = max(st.saved_pages, hit)
        if hit <= start:
            return 0, False
        st.load_from, st.load_to = start, hit
        return hit * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens == 0:
            st.load_from = st.load_to = 0

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = SluiceKVMetadata()
        running_saves, new_saves = [], []  # (state, request id, tokens computed after this step)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.blocks = list(new.block_ids[0])
            if st.load_to > st.load_from:
                meta.loads.append(_Transfer(new.req_id, [(st.digests[i], st.blocks[i])
                                                         for i in range(st.load_from, st.load_to)]))
                st.loaded_pages = st.load_to - st.load_from
            new_saves.append((st, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # back from preemption: these are all of its blocks now; what was saved stays saved
                st.blocks = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                st.blocks.extend(new_blocks[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            running_saves.append((st, req_id, done))
        planned = running_saves + new_saves
        if self._budget is not None:  # the budget pays first for the requests with the most still to generate
            planned = save_order([(p, _tokens_to_go(p[0].request)) for p in planned])
        for st, req_id, done in planned:
            self._plan_saves(st, req_id, done, meta)
        return meta

    def _plan_saves(self, st: _ReqState, req_id: str, computed_after_step: int, meta: SluiceKVMetadata) -> None:
        if not st.save:
            return
        tokens = st.request.all_token_ids
        full = min(computed_after_step, len(tokens)) // self.block_size
        full = min(full, len(st.blocks))
        st.full_pages = max(st.full_pages, full)
        if full <= st.saved_pages:
            return
        if self._budget is not None:
            # pages the budget cannot pay for now wait (their blocks stay put while the request runs)
            full = st.saved_pages + self._budget.grant(full - st.saved_pages)
            if full == st.saved_pages:
                return
        if len(st.digests) < full:
            st.digests = kv_pages.chain(st.seed, tokens, self.block_size, full)
        meta.saves.append(_Transfer(req_id, [(st.digests[i], st.blocks[i]) for i in range(st.saved_pages, full)]))
        st.saved_pages = full

    def update_connector_output(self, connector_output) -> None:
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, SluiceKVWorkerMetadata):
            for k, v in wm.counts.items():
                self._count_pending(k, v)
            for req_id, pages in wm.loaded_pages.items():
                st = self._reqs.get(req_id)
                if st is not None:
                    st.loaded_pages = pages

    def request_finished(self, request, block_ids):
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.save and st.full_pages > st.saved_pages:  # the budget never reached them: not saved
            self._count_pending("save_over_budget", st.full_pages - st.saved_pages)
        report = {"loaded_tokens": (st.loaded_pages or 0) * self.block_size, "counts": self._pending_counts}
        self._pending_counts = {}
        return False, {PARAMS_KEY: report}

    # -- model-runner side -----------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layer_names = sorted(kv_caches, key=_layer_order)
        self._mover = PageMover([kv_caches[n] for n in self._layer_names], self._num_blocks(kv_caches))

    def _num_blocks(self, kv_caches: dict[str, torch.Tensor]) -> int:
        config = getattr(self, "_kv_cache_config", None)
        if config is not None and getattr(config, "num_blocks", None):
            return int(config.num_blocks)
        return next(iter(kv_caches.values())).shape[0]  # no config: the block-first layout vLLM 0.32 uses

    def _page_mover(self, forward_context=None) -> PageMover | None:
        if self._mover is None:  # an engine that never called register_kv_caches
            if forward_context is None:
                from vllm.forward_context import get_forward_context

                forward_context = get_forward_context()
            caches = {name: layer.kv_cache for name, layer in forward_context.no_compile_layers.items()
                      if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)}
            if caches:
                self.register_kv_caches(caches)
        return self._mover

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SluiceKVMetadata) or not meta.loads:
            return
        mover = self._page_mover(forward_context)
        if mover is None:
            return
        dtype_name = str(mover.dtype).removeprefix("torch.")
        for transfer in meta.loads:
            started = time.perf_counter()
            values = self.redis.pipeline_run([("get", self._key(d)) for d, _ in transfer.pages])
            fetched = time.perf_counter()
            payloads, blocks = [], []
            for j, (digest, block) in enumerate(transfer.pages):
                try:
                    if values is None:
                        raise kv_pages.PageError("unavailable")
                    payload = kv_pages.decode(digest, self._open(digest, values[j]), dtype_name, mover.page_shape,
                                              len(mover.layers), mover.dtype.itemsize)
                except kv_pages.PageError as exc:
                    self._count(f"load_miss_{exc.reason}")
                    # this page and every later one are recomputed
                    self._load_errors.update(b for _, b in transfer.pages[j:])
                    break
                payloads.append(payload)
                blocks.append(block)
            decoded = time.perf_counter()
            if payloads:
                # queued on the current stream, ahead of the forward pass that reads these blocks
                mover.load(blocks, mover.host_pages(payloads))
                self._count("loaded_pages", len(payloads))
                self._count("loaded_bytes", sum(len(p) for p in payloads))
            self._loaded[transfer.req_id] = len(payloads)
            self._count_time("loaded", "redis", fetched - started)
            self._count_time("loaded", "decode", decoded - fetched)
            self._count_time("loaded", "copy", time.perf_counter() - decoded)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SluiceKVMetadata) or not meta.saves:
            return
        mover = self._page_mover()
        if mover is None:
            return
        if self._save_index is None:
            self._save_index = mover.index([b for t in meta.saves for _, b in t.pages])
        # a device-side copy now, on the forward's stream: the blocks may be reused once the request finishes
        self._save_buf[layer_name] = mover.gather_layer(kv_layer, self._save_index)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        buf, self._save_buf, self._save_index = self._save_buf, {}, None
        if not isinstance(meta, SluiceKVMetadata) or not meta.saves or not buf or self._mover is None:
            return
        computed = time.perf_counter()  # the step that computed these pages has just ended
        names = sorted(buf, key=_layer_order)
        # device -> pinned host on a side stream; the writer thread waits for the copy, not the forward pass
        pending = self._mover.to_host([buf[n] for n in names])
        digests = [d for t in meta.saves for d, _ in t.pages]
        writer = self._writer_queue()
        for i, digest in enumerate(digests):
            if writer.qsize() >= self._max_queue:
                self._count("save_dropped")
                continue
            writer.put((digest, pending, i, len(names), computed))

    def _writer_queue(self) -> queue.Queue:
        if self._writer is None:
            self._writer = queue.Queue()
            threading.Thread(target=self._write_loop, name="sluice-kv-writer", daemon=True).start()
        return self._writer

    def _write_loop(self) -> None:
        q = self._writer
        mover = self._mover
        dtype_name = str(mover.dtype).removeprefix("torch.")
        while True:
            batch = [q.get()]
            while len(batch) < 64:
                try:
                    batch.append(q.get_nowait())
                except queue.Empty:
                    break
            started = time.perf_counter()
            if self.sealer is None:  # sent as the pieces lie in memory
                items = [(self._key(digest), kv_pages.encode_pieces(digest, dtype_name, mover.page_shape, layers,
                                                                    pending.page_parts(i)))
                         for digest, pending, i, layers, _ in batch]
                encoded = time.perf_counter()
                done = self.redis.set_pieces(items, self.ttl_s)
                sizes = [sum(memoryview(p).nbytes for p in pieces) for _, pieces in items]
            else:  # the cipher needs the whole value
                values = []
                for digest, pending, i, layers, _ in batch:
                    value = kv_pages.encode_parts(digest, dtype_name, mover.page_shape, layers, pending.page_parts(i))
                    values.append((digest, self.sealer.seal(value, self._key(digest))))
                encoded = time.perf_counter()
                done = self.redis.pipeline_run([("set", self._key(d), v, self.ttl_s) for d, v in values])
                sizes = [len(v) for _, v in values]
            finished = time.perf_counter()
            # encode: waiting for the pages' copy to the host, framing (and sealing); redis: the SET round
            self._count_time("stored", "encode", encoded - started)
            self._count_time("stored", "redis", finished - encoded)
            if done is None:
                self._count("save_failed", len(sizes))
            else:
                # how long each page was computed but not yet in Redis: its wait in this queue, the copy
                # to host memory, framing, and its own SET (sealed pages: the batch's one pipeline)
                landed = done if self.sealer is None else [finished] * len(batch)
                self._count("page_lag_us", round(sum(t - item[-1] for t, item in zip(landed, batch)) * 1e6))
                self._count("stored_pages", len(sizes))
                self._count("stored_bytes", sum(sizes))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self):
        with self._lock:
            if not self._counts and not self._loaded:
                return None
            meta = SluiceKVWorkerMetadata(self._counts, self._loaded)
            self._counts, self._loaded = {}, {}
        return meta
