"""Final answers and progress checkpoints in Redis Cluster, keyed by request id.

Progress: before a token record is produced, its chunk (seq, token ids, text) is
written to the request's progress hash (write-ahead), so a worker that picks
the request up after its owner died knows every token that may have reached a
reader, re-sends those records unchanged, and continues after them. Answering
the request deletes its progress.

A request id is the producer's idempotency key. When a worker answers a request
it stores the encoded final reply (`done` or `error`) with a TTL; a record that
arrives again with the same id gets that stored reply re-sent instead of a second
run. Lookups are pipelined per intake batch; writes are queued and pipelined by
one background task, so neither holds an engine slot. A record's offset is finished
(and so committable) only once its answer is stored, or the write failed because
Redis is degraded: a redelivered record then finds its answer instead of resuming
past its end. A worker that dies between producing a reply and writing its answer
leaves that record uncommitted; whoever reads it again runs it again. Redis trouble degrades, never stops: every call has a short timeout, and
after a failure Redis is left alone for a back-off period while requests are
served without the check.

With an encryption keys file (worker/sealing.py) every answer and progress field is sealed,
bound to the key (and field) it is stored under; a value that fails to open is treated as absent
(the request runs, or starts over) and counted in `sluice_state_rejected_total`. Keys are named
by tenant and request id (`Job.state_id`), so one tenant's id never finds another tenant's answer.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import msgspec

import structlog
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from worker import metrics
from worker.redis_client import retry_once
from worker.redis_rounds import Script, run_scripts
from worker.redis_seeds import SeedNodes, redacted
from worker.sealing import KeyRing, Sealer, Unsealable

log = structlog.get_logger("sluice.answers")
_chunk_enc = msgspec.msgpack.Encoder()
_chunk_dec = msgspec.msgpack.Decoder(tuple[list[int], str])
_scores_dec = msgspec.msgpack.Decoder(dict[str, float])


MIXED = "mixed"  # progress whose ids come from more than one tokenizer: only its text can be trusted


@dataclass(frozen=True)
class Progress:
    """What an earlier owner of a request emitted: contiguous chunks from seq 0."""

    chunks: list[tuple[list[int], str]]
    scores: dict[str, float] | None = None
    # what the chunks' token ids mean (`Engine.tokenizer_id`), or MIXED once a worker with another
    # tokenizer went on from them; None for progress written before sluice stored it (ids trusted)
    tokenizer: str | None = None

    @classmethod
    def from_hash(cls, h: dict | None, unseal=lambda field, raw: raw) -> "Progress | None":
        if not h:
            return None
        chunks = []
        try:
            while (raw := h.get(f"c{len(chunks)}".encode())) is not None:
                chunks.append(_chunk_dec.decode(unseal(f"c{len(chunks)}", raw)))
            scores = _scores_dec.decode(unseal("scores", h[b"scores"])) if b"scores" in h else None
            tokenizer = unseal("tok", h[b"tok"]).decode(errors="replace") if b"tok" in h else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # unreadable progress: start over rather than guess
        except Unsealable as exc:
            metrics.state_rejected.labels("progress", exc.reason).inc()
            return None  # forged or altered progress: start over, never continue from it
        return cls(chunks, scores, tokenizer) if chunks else None
# Fencing: each run of a request claims it (`SET owner`); progress and the answer are written only
# by the run that holds the claim. KEYS[1] is the owner key; an empty owner (ARGV[1]) writes anyway
# (the claim could not be made: Redis was away then). A claim that is gone with no answer stored was
# not taken over: it was lost (a Redis node failed over or restarted before it had the key). That run
# takes its claim again and goes on (returns 2), rather than being fenced with nobody left to answer.
# Progress: KEYS[2] the progress hash, KEYS[3] the answer; ARGV[2] the TTL, then field/value pairs.
_APPEND_IF_OWNER = Script("""
local retaken = 0
if ARGV[1] ~= '' then
  local holder = redis.call('GET', KEYS[1])
  if holder ~= ARGV[1] then
    if holder or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
    redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
    retaken = 1
  end
end
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1 + retaken
""")
# Intake: KEYS[1] the answer, KEYS[2] the progress, KEYS[3] the owner key; ARGV[1] the attempt's owner
# token ('' claims nothing), ARGV[2] the claim's TTL, ARGV[3] '1' to read the progress. A stored answer is
# returned as {1, answer} and nothing is claimed (the id is answered from it); otherwise {0, progress
# as HGETALL's flat list}, claimed after the progress was read, in one round and one step.
_LOOKUP_AND_CLAIM = Script("""
local answer = redis.call('GET', KEYS[1])
if answer then return {1, answer} end
local progress = {}
if ARGV[3] == '1' then progress = redis.call('HGETALL', KEYS[2]) end
if ARGV[1] ~= '' then redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[2]) end
return {0, progress}
""")
# Handoff (worker/handoff.py): KEYS as intake's; ARGV[1] the dead run's token, ARGV[2] the adopting run's,
# ARGV[3] the claim's TTL, ARGV[4] '1' to read the progress. Claimed only from the dead run: {0, progress};
# {1} when answered, {2} when another run holds (or lost) the claim. So one survivor adopts a request.
_ADOPT = Script("""
if redis.call('EXISTS', KEYS[1]) == 1 then return {1} end
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return {2} end
redis.call('SET', KEYS[3], ARGV[2], 'EX', ARGV[3])
local progress = {}
if ARGV[4] == '1' then progress = redis.call('HGETALL', KEYS[2]) end
return {0, progress}
""")
ADOPTED, ANSWERED, TAKEN = 0, 1, 2
# Answer: KEYS[2] the answer, KEYS[3] the progress (removed with the claim); ARGV[2] the answer, ARGV[3] its TTL.
# A lost claim (gone, no answer stored) is stored over as above (returns 2).
_ANSWER_IF_OWNER = Script("""
local retaken = 0
if ARGV[1] ~= '' then
  local holder = redis.call('GET', KEYS[1])
  if holder ~= ARGV[1] then
    if holder or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
    retaken = 1
  end
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
redis.call('DEL', KEYS[1], KEYS[3])
return 1 + retaken
""")


def _resolve(futures, ok: bool) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_result(ok)


# RedisClusterException ("no reachable node") is not a RedisError.
REDIS_DOWN = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


async def _close_quietly(client) -> None:
    try:
        await client.aclose()
    except Exception:  # noqa: BLE001 - it is being thrown away
        pass


class AnswerStore:
    def __init__(self, url: str, prefix: str, ttl_s: int, timeout_ms: int, backoff_s: float = 2.0,
                 progress_ttl_s: int = 86400, sealer: Sealer | KeyRing | None = None, client_options: dict | None = None):
        self.url, self.prefix, self.ttl_s, self.progress_ttl_s = url, prefix, ttl_s, progress_ttl_s
        self.sealer = sealer
        self.client_options = client_options or {}  # credentials and TLS (RedisSettings.client_options)
        self.timeout = timeout_ms / 1000
        self.backoff_s = backoff_s
        self.seeds = SeedNodes(url)
        self._client: RedisCluster | None = None
        self.available = False
        self._prober: asyncio.Task | None = None  # reconnects while Redis is away (`_probe`)
        # monotonic: since when calls have failed, from the first failure until a call succeeds (a
        # reconnect alone does not end it: a full cluster accepts connections and refuses writes);
        # intake's wait for Redis counts from here (worker/intake.py: _schedule)
        self.unavailable_since: float | None = None
        self._pending: list[tuple[str, bytes, bool, asyncio.Future]] = []
        self._appends: list[tuple[str, list, asyncio.Future]] = []  # write-ahead of token records
        self._flush_wanted = asyncio.Event()
        self._writer: asyncio.Task | None = None

    def key(self, request_id: str) -> str:
        # The hash tag keeps every key of one request in one slot.
        return f"{self.prefix}:req:{{{request_id}}}:answer"

    def progress_key(self, request_id: str) -> str:
        return f"{self.prefix}:req:{{{request_id}}}:progress"

    def owner_key(self, request_id: str) -> str:
        return f"{self.prefix}:req:{{{request_id}}}:owner"

    async def start(self) -> None:
        await self._connect()
        self._writer = asyncio.create_task(self._write_loop(), name="sluice-answers-writer")

    @property
    def writer(self) -> asyncio.Task | None:
        """The background answer writer (the worker's supervisor watches it)."""
        return self._writer

    def put_later(self, request_id: str, final_reply: bytes, owner: str = "", limit: int = 10_000) -> asyncio.Future:
        """Queue an answer for the writer. The future resolves True once it is stored, False when
        another run owns the request now (this one is fenced: nothing was stored), None when it
        could not be stored (Redis degraded, or dropped from a full queue while Redis was away).

        Storing an answer also removes the request's progress and claim.
        """
        done = asyncio.get_running_loop().create_future()
        self._pending.append((request_id, final_reply, owner, done))
        if len(self._pending) > limit:
            dropped = self._pending[: len(self._pending) - limit]
            del self._pending[: len(self._pending) - limit]
            _resolve([item[3] for item in dropped], None)
        self._flush_wanted.set()
        return done

    async def _write_loop(self) -> None:
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            # answers wait a moment for company; a token record waits on its append, so those go at once
            # (while one round is in flight the next gathers every append made meanwhile)
            await asyncio.sleep(0 if self._appends else 0.002)
            await self.flush()

    async def flush(self) -> None:
        appends, self._appends = self._appends, []
        batch, self._pending = self._pending, []
        if not batch and not appends:
            return
        futures = [item[2] for item in appends] + [item[3] for item in batch]
        try:
            # appends first: a request's last chunks and its answer may share a round, and the answer
            # removes the progress (one request's keys share a slot, so one node runs them in order)
            results = await self._write(appends, [item[:3] for item in batch])
        except BaseException:
            _resolve(futures, None)
            raise
        for future, ok in zip(futures, results):
            if not future.done():
                future.set_result(ok)

    async def _connect(self, write_check: bool = False) -> bool:
        """A new client; with `write_check` (the reconnect task), only one that can also store: a full
        cluster accepts connections and refuses writes, and counting it back would make the store
        flicker between available and not every few seconds."""
        client = None
        try:
            client = RedisCluster.from_url(
                self.seeds.url, startup_nodes=self.seeds.startup_nodes(ClusterNode),
                socket_timeout=self.timeout, socket_connect_timeout=self.timeout, retry=retry_once(asynchronous=True),
                **self.client_options)
            async with asyncio.timeout(self.timeout * 4):  # not wait_for: 3.11's can swallow a cancellation
                await client.initialize()
                if write_check:
                    await client.set(f"{self.prefix}:probe:{{{secrets.token_hex(4)}}}", b"1", ex=10)
            self.seeds.remember(client.get_nodes())
            self._client = client
            self._mark(True)
            return True
        except Exception as exc:  # noqa: BLE001 - see _call
            self._mark(False, exc)
            if client is not None:
                asyncio.create_task(_close_quietly(client))
            return False

    def _mark(self, ok: bool, exc: Exception | None = None) -> None:
        if ok != self.available:
            if ok:
                log.info("redis_available", url=redacted(self.url))
            else:
                log.warning("redis_unavailable", url=redacted(self.url), error=repr(exc))
        self.available = ok
        metrics.redis_up.set(1 if ok else 0)
        if not ok:
            if self.unavailable_since is None:
                self.unavailable_since = time.monotonic()
            self._probe_later()

    def _probe_later(self) -> None:
        """While Redis is away no call waits on it: each is answered as degraded at once, and this
        one task tries to reconnect every `backoff_s` until it can. (When each call after a back-off
        tried to reconnect itself, every lookup and write stood still for up to four timeouts every
        few seconds of a hung cluster.)"""
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe(), name="sluice-answers-probe")

    async def _probe(self) -> None:
        while not self.available:
            await asyncio.sleep(self.backoff_s)
            await self._connect(write_check=True)

    async def _call(self, fn):
        if not self.available or self._client is None:
            return None  # degraded: `_probe` reconnects
        try:
            async with asyncio.timeout(self.timeout * 4):
                result = await fn(self._client)
            self._mark(True)
            self.unavailable_since = None
            return result
        except Exception as exc:  # noqa: BLE001 - any client failure (redis-py raises more than RedisError mid-failover) degrades
            self._mark(False, exc)
            # a client that failed mid-failover can stay broken: start from a fresh one after the back-off
            client, self._client = self._client, None
            if client is not None:
                self.seeds.remember(client.get_nodes())
                asyncio.create_task(_close_quietly(client))
            return None

    async def get(self, request_id: str) -> bytes | None:
        return self._open_answer(request_id, await self._call(lambda c: c.get(self.key(request_id))))

    def _open_answer(self, request_id: str, raw: bytes | None) -> bytes | None:
        if raw is None or self.sealer is None:
            return raw
        try:
            return self.sealer.open(raw, self.key(request_id))
        except Unsealable as exc:
            metrics.state_rejected.labels("answer", exc.reason).inc()
            log.warning("stored_answer_rejected", reason=exc.reason)
            return None  # the request runs again; its new answer replaces the bad value

    def _unsealer(self, request_id: str):
        if self.sealer is None:
            return lambda field, raw: raw
        key = self.progress_key(request_id)
        return lambda field, raw: self.sealer.open(raw, f"{key}\0{field}")

    def _seal_field(self, request_id: str, field: str, value: bytes) -> bytes:
        if self.sealer is None:
            return value
        return self.sealer.seal(value, f"{self.progress_key(request_id)}\0{field}")

    async def lookup_many(self, request_ids: list[str], streamed: list[bool],
                          owners: list[str] | None = None) -> list[tuple[bytes | None, Progress | None]]:
        """(stored answer, progress) per id, one pipelined round of one script per id; (None, None)s
        when degraded.

        Only streamed requests write progress, so only theirs is read. With `owners`, each request
        without an answer is also claimed for that attempt token (after its progress is read, in the
        same script): from then on only
        that attempt may add progress or store the answer (`append_chunks`, `put_later`), which fences
        an earlier owner that was paused past its session timeout and wakes up still running it.
        """
        if not request_ids:
            return []
        claiming = owners or [""] * len(request_ids)

        found = await self._call(lambda c: run_scripts(c, [
            (_LOOKUP_AND_CLAIM, [self.key(rid), self.progress_key(rid), self.owner_key(rid)],
             [owner, self.progress_ttl_s, "1" if stream else "0"])
            for rid, stream, owner in zip(request_ids, streamed, claiming)]))
        if found is None:
            return [(None, None)] * len(request_ids)
        out, refused = [], []
        for i, (rid, stream, (answered, value)) in enumerate(zip(request_ids, streamed, found)):
            if answered:
                answer = self._open_answer(rid, value)
                out.append((answer, None))
                if answer is None:  # a stored value that fails to open is no answer: the id runs again
                    refused.append(i)
            else:
                progress = dict(zip(value[::2], value[1::2]))
                out.append((None, Progress.from_hash(progress, self._unsealer(rid)) if stream else None))
        if refused:
            await self._claim_refused(refused, request_ids, streamed, claiming, out)
        return out

    async def adopt(self, request_id: str, streamed: bool, dead_owner: str, owner: str
                    ) -> tuple[int | None, Progress | None]:
        """Claim `request_id` for `owner` only while the dead run `dead_owner` holds it: (ADOPTED, its
        progress), (ANSWERED, None), (TAKEN, None); (None, None) when Redis did not answer."""
        found = await self._call(lambda c: run_scripts(c, [
            (_ADOPT, [self.key(request_id), self.progress_key(request_id), self.owner_key(request_id)],
             [dead_owner, owner, self.progress_ttl_s, "1" if streamed else "0"])]))
        if found is None:
            return None, None
        status = int(found[0][0])
        if status != ADOPTED:
            return status, None
        value = found[0][1]
        progress = dict(zip(value[::2], value[1::2]))
        return ADOPTED, Progress.from_hash(progress, self._unsealer(request_id)) if streamed else None

    async def _claim_refused(self, refused: list[int], request_ids, streamed, owners, out) -> None:
        """Ids whose stored answer was refused run again: read their progress and claim them, as the
        lookup does for ids with no answer."""
        async def run(c):
            pipe = c.pipeline()
            for i in refused:
                pipe.hgetall(self.progress_key(request_ids[i]))
                if owners[i]:
                    pipe.set(self.owner_key(request_ids[i]), owners[i], ex=self.progress_ttl_s)
            return await pipe.execute()

        found = await self._call(run)
        if found is None:
            return
        at = 0
        for i in refused:
            rid = request_ids[i]
            out[i] = (None, Progress.from_hash(found[at], self._unsealer(rid)) if streamed[i] else None)
            at += 2 if owners[i] else 1

    async def append_chunks(self, request_id: str, chunks: list[tuple[int, list[int], str]],
                            scores: dict[str, float] | None = None, owner: str | None = None,
                            tokenizer: str | None = None) -> bool | None:
        """Write-ahead of token records (seq, token ids, text): True once stored, None while Redis is
        degraded, False when another attempt owns the request now (this one is fenced).

        A token record is produced only after this returned True for its chunk. `tokenizer` names
        what the ids mean (`Progress.tokenizer`): given with the first chunk a run stores.
        """
        fields = {f"c{seq}": self._seal_field(request_id, f"c{seq}", _chunk_enc.encode((token_ids, text)))
                  for seq, token_ids, text in chunks}
        if scores is not None:
            fields["scores"] = self._seal_field(request_id, "scores", _chunk_enc.encode(scores))
        if tokenizer is not None:
            fields["tok"] = self._seal_field(request_id, "tok", tokenizer.encode())
        args = [owner or "", self.progress_ttl_s] + [x for kv in fields.items() for x in kv]
        if self._writer is None or self._writer.done():  # not started (or stopping): one round of its own
            return (await self._write([(request_id, args, None)], []))[0]
        # the writer pipelines every append made meanwhile into one round: one Redis round trip per
        # turn of the worker rather than per token record
        done = asyncio.get_running_loop().create_future()
        self._appends.append((request_id, args, done))
        self._flush_wanted.set()
        return await done

    async def put_many(self, items: list[tuple[str, bytes, str]]) -> list[bool | None]:
        """Store (id, answer, owner) in one pipelined round, each only if `owner` still owns the id
        ("" stores unconditionally); per item True / False (fenced) / None (Redis degraded)."""
        return await self._write([], items)

    async def _write(self, appends: list[tuple[str, list, object]], answers: list[tuple[str, bytes, str]]
                     ) -> list[bool | None]:
        """One pipelined round: progress appends (id, script args), then answers (id, answer, owner)."""
        calls = [(_APPEND_IF_OWNER, [self.owner_key(rid), self.progress_key(rid), self.key(rid)], args)
                 for rid, args, _ in appends]
        for rid, payload, owner in answers:
            if self.sealer is not None:
                payload = self.sealer.seal(payload, self.key(rid))
            calls.append((_ANSWER_IF_OWNER, [self.owner_key(rid), self.key(rid), self.progress_key(rid)],
                          [owner, payload, self.ttl_s]))
        n = len(calls)
        found = await self._call(lambda c: run_scripts(c, calls)) if calls else []
        if found is None:
            return [None] * n
        ids = [rid for rid, _, _ in appends] + [rid for rid, _, _ in answers]
        for rid, x in zip(ids, found):
            if x == 2:
                metrics.claims_retaken.inc()
                log.warning("claim_retaken", request_id=rid,
                            note="the request's claim was gone with no answer stored (lost in Redis): taken again")
        return [bool(x) for x in found]

    async def ping(self) -> bool:
        return bool(await self._call(lambda c: c.ping()))

    async def stop(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
            await self.flush()
        if self._client is not None:
            try:
                await self._client.aclose()
            except REDIS_DOWN:
                pass
            self._client = None
