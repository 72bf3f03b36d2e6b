"""Every metric name in one module. Labels: `class` is the latency class."""

from __future__ import annotations

from bisect import bisect_left

import prometheus_client
from prometheus_client import CollectorRegistry

REGISTRY = CollectorRegistry()


class _CachedLabels:
    """`labels()` answered from a dict of the children already made: prometheus-client validates,
    converts and locks on every call, about 18 times per request on the hot path."""

    def labels(self, *values, **kw):
        if kw:
            return super().labels(*values, **kw)
        cache = self.__dict__.setdefault("_sluice_children", {})
        try:
            return cache[values]
        except KeyError:
            child = cache[values] = super().labels(*values)
            return child

    def remove(self, *values):
        self.__dict__.get("_sluice_children", {}).clear()
        super().remove(*values)

    def clear(self):
        self.__dict__.get("_sluice_children", {}).clear()
        super().clear()


class Counter(_CachedLabels, prometheus_client.Counter):
    def inc(self, amount: float = 1, exemplar=None) -> None:
        # a child's increment without prometheus-client's per-call checks, which cost as much as the
        # increment (about 20 per streamed request); anything unusual takes its own path
        if exemplar is not None or (self._labelnames and not self._labelvalues) or not amount >= 0:
            return super().inc(amount, exemplar)
        self._value.inc(amount)


class Gauge(_CachedLabels, prometheus_client.Gauge):
    pass


class Histogram(_CachedLabels, prometheus_client.Histogram):
    def observe(self, amount: float, exemplar=None) -> None:
        # a child's observation found by bisection, not prometheus-client's walk over every bucket;
        # bucket i counts amounts <= its bound, as there (NaN and exemplars take its own path)
        if exemplar is not None or (self._labelnames and not self._labelvalues) or amount != amount:
            return super().observe(amount, exemplar)
        self._sum.inc(amount)
        self._buckets[bisect_left(self._upper_bounds, amount)].inc(1)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

records_consumed = Counter("sluice_records_consumed_total", "Request records read", ["class"], registry=REGISTRY)
untrusted_timestamps = Counter(
    "sluice_untrusted_timestamps_total", "Request records whose timestamp cannot be true (before the topic's "
    "retention, or ahead of the worker's clock by more than the allowed skew): timed from when they were read",
    ["class"], registry=REGISTRY)
records_expired = Counter(
    "sluice_records_expired_total", "Request records the topic's retention (or DeleteRecords) removed before any "
    "worker read them: lost, counted when the worker finds its group's offset below the partition's first record",
    ["class"], registry=REGISTRY)
requests_completed = Counter(
    "sluice_requests_completed_total", "Requests answered, by outcome (finish reason or error code)",
    ["class", "outcome"], registry=REGISTRY,
)
bad_records = Counter("sluice_bad_records_total", "Records rejected, by error code and where the answer went",
                      ["code", "route"], registry=REGISTRY)
duplicates = Counter("sluice_duplicate_requests_total", "Requests whose id was already answered", ["class"],
                     registry=REGISTRY)
waiting = Gauge("sluice_requests_waiting", "Requests read and waiting for admission", ["class"], registry=REGISTRY)
in_engine = Gauge("sluice_requests_in_engine", "Requests admitted to the engine", ["class"], registry=REGISTRY)
admission_cap = Gauge("sluice_admission_cap", "Requests of the class the engine may hold now (its contended cap "
                      "while a higher class has work; with admission slo or step, steered by that class's latency "
                      "or the engine's step time)",
                      ["class"], registry=REGISTRY)
engine_step = Gauge("sluice_engine_step_seconds", "The engine's step time as admission \"step\" fits it: the fixed "
                    "part, the part per decoded token and per prompt token in the step (absent until fitted)",
                    ["part"], registry=REGISTRY)
paused_partitions = Gauge("sluice_paused_partitions", "Partitions paused for backpressure", ["class"],
                          registry=REGISTRY)
tokens_generated = Counter("sluice_tokens_generated_total", "Completion tokens", ["class"], registry=REGISTRY)
prompt_tokens = Counter("sluice_prompt_tokens_total", "Prompt tokens", ["class"], registry=REGISTRY)
reply_fallbacks = Counter("sluice_reply_fallbacks_total",
                          "Final replies sent to the default reply topic because reply_to was unusable",
                          registry=REGISTRY)
reply_records = Counter("sluice_reply_records_total", "Reply records produced", ["type"], registry=REGISTRY)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
SCORE_BUCKETS = tuple(i / 20 for i in range(1, 21))
# `tenant` is a field producers write: bound the series a hostile producer could create.
MAX_TENANT_LABELS = 100
OTHER_TENANTS = "_other"
_tenants_seen: set[str] = set()

class_slo = Gauge("sluice_class_slo_seconds", "Each class's end-to-end latency objective (slo_ms of its topic)",
                  ["class"], registry=REGISTRY)
consumer_lag = Gauge("sluice_consumer_lag_records",
                     "Records of an assigned partition not yet committed (log end offset - committed offset)",
                     ["class", "partition"], registry=REGISTRY)
inter_token = Histogram("sluice_inter_token_seconds", "Time between a request's successive tokens",
                        ["class"], buckets=ITL_BUCKETS, registry=REGISTRY)
scores = Histogram("sluice_score", "Scores given (probability of each label), by template and the template's own "
                   "labels (labels a request names itself are not recorded: any producer could add series)",
                   ["template", "label"], buckets=SCORE_BUCKETS, registry=REGISTRY)
tenant_requests = Counter("sluice_tenant_requests_total",
                          f"Requests answered, by tenant and outcome (the first {MAX_TENANT_LABELS} tenants seen "
                          f"by this process by name, later ones as {OTHER_TENANTS})", ["tenant", "outcome"],
                          registry=REGISTRY)
ready = Gauge("sluice_ready", "1 while /readyz answers 200 (read at each scrape)", registry=REGISTRY)
fetch_wait = Gauge("sluice_fetch_wait_seconds", "How long the partition the worker would read that has waited longest "
                   "for a fetch answer has waited; the worker fails at SLUICE_FETCH_OUTAGE_S", registry=REGISTRY)
time_to_first_token = Histogram("sluice_time_to_first_token_seconds", "From record timestamp to first token",
                                ["class"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
end_to_end = Histogram("sluice_end_to_end_seconds", "From record timestamp to done/error produced",
                       ["class"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
STAGES = ("fetch", "admission", "engine", "reply")
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
stage_seconds = Histogram(
    "sluice_stage_seconds", "Where a request's end-to-end time goes: fetch (record timestamp to read by the "
    "worker), admission (read to engine: intake window, stored-answer lookup and claim, queue), engine, "
    "reply (answer stored, done produced and acknowledged)", ["class", "stage"], buckets=STAGE_BUCKETS,
    registry=REGISTRY)
suspended = Counter("sluice_requests_suspended_total", "Running requests suspended for a higher class",
                    ["class"], registry=REGISTRY)
commits = Counter("sluice_offset_commits_total", "Offset commits", ["result"], registry=REGISTRY)
redis_up = Gauge("sluice_redis_up", "1 when Redis Cluster answers, 0 while degraded", registry=REGISTRY)
engine_up = Gauge("sluice_engine_up", "1 while the engine serves", registry=REGISTRY)
engine_memory = Gauge("sluice_engine_processes_resident_bytes",
                      "Resident memory of the processes below the worker, summed (read at each scrape): vLLM's "
                      "engine core and its forkserver or model runner, and the guards. The worker's own is "
                      "process_resident_memory_bytes", registry=REGISTRY)
event_loop_lag = Histogram(
    "sluice_event_loop_lag_seconds", "How late the worker's event loop woke its health monitor: while it is late, "
    "no request of the worker moves (a long garbage collection, blocking work)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=REGISTRY)

# KV pages in Redis (reported by the engine's connector with each finished request)
prefill_tokens = Counter("sluice_prefill_tokens_total",
                         "Prompt tokens by where their KV came from: computed, local_cache, redis",
                         ["class", "source"], registry=REGISTRY)
kv_pages = Counter("sluice_kv_pages_total", "KV pages moved to or from Redis", ["op"], registry=REGISTRY)
kv_bytes = Counter("sluice_kv_bytes_total", "KV page bytes moved to or from Redis", ["op"], registry=REGISTRY)
# where moving pages takes its time, by op and part; summed over the engine's workers (one on CPU)
KV_SECONDS_PARTS = {"loaded": ("redis", "decode", "copy"), "stored": ("encode", "redis")}
kv_seconds = Counter("sluice_kv_seconds_total",
                     "Seconds the engine's connector spent moving KV pages: loaded (redis: the GET round; decode: "
                     "checks and unsealing; copy: into the KV cache, queued only on an accelerator), stored (encode: "
                     "waiting for the copy to host memory, framing and sealing; redis: the SET round)",
                     ["op", "part"], registry=REGISTRY)
kv_page_lag = Counter("sluice_kv_page_lag_seconds_total",
                      "Summed over the KV pages stored: seconds from the engine step that computed a page until Redis "
                      "had it (the writer's queue, the copy to host memory, framing, the SET round). Divided by "
                      "sluice_kv_pages_total{op=\"stored\"}: how long a computed page is not yet insured, on average",
                      registry=REGISTRY)
kv_load_misses = Counter("sluice_kv_load_misses_total",
                         "Stored pages not used (recomputed instead), by reason: missing, corrupt, checksum, "
                         "layout, unavailable; with encryption also forged, not_sealed, unknown_key", ["reason"], registry=REGISTRY)
kv_save_failures = Counter("sluice_kv_save_failures_total",
                           "Pages not saved: over_budget (kv.save_budget_mib_s), dropped (writer behind) or failed",
                           ["reason"], registry=REGISTRY)
kv_lookups_unavailable = Counter("sluice_kv_lookups_unavailable_total",
                                 "Page lookups skipped because Redis was unavailable", registry=REGISTRY)
resumed = Counter("sluice_requests_resumed_total", "Requests continued from another worker's progress",
                  ["class"], registry=REGISTRY)

# Failing closed, fencing and the contract's safety nets
worker_failures = Counter("sluice_worker_failures_total",
                          "Reasons a worker stopped itself (a stage failed, the engine stalled or died, ...)",
                          ["reason"], registry=REGISTRY)
guard_restarts = Counter("sluice_guard_restarts_total",
                         "Guard processes (engine, group) started again after they died while their worker ran",
                         ["guard"], registry=REGISTRY)
for _guard in ("engine", "group"):
    guard_restarts.labels(_guard)  # exported at 0 from the start, so the first restart is an increase
intake_errors = Counter("sluice_intake_errors_total",
                        "Records whose handling raised unexpectedly (answered `internal`), or fetches that failed",
                        ["class", "kind"], registry=REGISTRY)
answers_unstored = Counter("sluice_answers_unstored_total",
                           "Final replies whose answer could not be stored (Redis degraded): a repeat of the id runs again",
                           registry=REGISTRY)
token_resends = Counter("sluice_token_resends_total",
                        "Token records sent again (and awaited) before `done` because a delivery failed",
                        registry=REGISTRY)
revoke_aborted = Counter("sluice_revoke_aborted_total",
                         "Requests aborted because their partition was revoked (the new owner continues them)",
                         registry=REGISTRY)
tokens_held = Counter("sluice_tokens_held_total",
                      "Token records held back because their progress could not be stored (Redis degraded)",
                      registry=REGISTRY)
unauthenticated = Counter("sluice_records_unauthenticated_total",
                          "Records dead-lettered because their tenant could not be authenticated (tenancy_mode signed)",
                          ["class"], registry=REGISTRY)
state_rejected = Counter("sluice_state_rejected_total",
                         "Values read from Redis and not used because they failed authentication (forged, altered, "
                         "stored under another key, unknown key id, not sealed): kind answer | progress",
                         ["kind", "reason"], registry=REGISTRY)
fenced = Counter("sluice_attempts_fenced_total",
                 "Attempts stopped because another worker claimed their request (this one was paused too long)",
                 registry=REGISTRY)
claims_retaken = Counter("sluice_claims_retaken_total",
                         "A run found its request's claim gone with no answer stored (lost in a Redis failover or "
                         "restart) and took it again instead of counting itself fenced", registry=REGISTRY)
handoff = Counter("sluice_handoff_total",
                  "Requests a dead worker's guard handed over (SLUICE_GROUP_HANDOFF), by what this worker did: "
                  "adopted (claimed from the dead run and continued here), answered (it had an answer already), "
                  "taken (another run holds its claim), failed (its record could not be read or run here), "
                  "landed (its partition came here while it ran, and the run became the record's)",
                  ["outcome"], registry=REGISTRY)


def tenant_label(tenant: str) -> str:
    if tenant in _tenants_seen:
        return tenant
    if len(_tenants_seen) < MAX_TENANT_LABELS:
        _tenants_seen.add(tenant)
        return tenant
    return OTHER_TENANTS


def record_kv(cls: str, prompt_len: int, cached_tokens: int, kv: dict | None) -> None:
    """Account one finished request's prefill and the connector counts it carried."""
    loaded = int((kv or {}).get("loaded_tokens", 0))
    prefill_tokens.labels(cls, "redis").inc(loaded)
    prefill_tokens.labels(cls, "local_cache").inc(max(0, cached_tokens - loaded))
    prefill_tokens.labels(cls, "computed").inc(max(0, prompt_len - max(cached_tokens, loaded)))
    for name, n in ((kv or {}).get("counts") or {}).items():
        if name in ("stored_pages", "loaded_pages"):
            kv_pages.labels(name.removesuffix("_pages")).inc(n)
        elif name in ("stored_bytes", "loaded_bytes"):
            kv_bytes.labels(name.removesuffix("_bytes")).inc(n)
        elif name.startswith("us_"):  # worker/kv_connector.py: _count_time
            op, _, part = name.removeprefix("us_").partition("_")
            if part in KV_SECONDS_PARTS.get(op, ()):
                kv_seconds.labels(op, part).inc(n / 1e6)
        elif name == "page_lag_us":
            kv_page_lag.inc(n / 1e6)
        elif name.startswith("load_miss_"):
            kv_load_misses.labels(name.removeprefix("load_miss_")).inc(n)
        elif name.startswith("save_"):
            kv_save_failures.labels(name.removeprefix("save_")).inc(n)
        elif name == "lookup_unavailable":
            kv_lookups_unavailable.inc(n)


# Known label values start at zero, so that a rate() sees the first increment and dashboards show
# every class before its first request. (Outcomes: finish reasons and the contract's error codes.)
OUTCOMES = ("stop", "length", "scored", "invalid_request", "payload_too_large", "deadline_exceeded", "overloaded",
            "internal")
PAGE_MISS_REASONS = ("missing", "corrupt", "checksum", "layout", "unavailable", "forged", "not_sealed", "unknown_key")
# why a sealed value was not used (worker/sealing.py)
UNSEALABLE_REASONS = ("not_sealed", "corrupt", "unknown_key", "forged")


HANDOFF_OUTCOMES = ("adopted", "answered", "taken", "failed", "landed")


def start_series(classes) -> None:
    for outcome in HANDOFF_OUTCOMES:  # zero from the start, so a dashboard shows none happened
        handoff.labels(outcome)
    for cls in classes:
        for family in (records_consumed, untrusted_timestamps, records_expired, tokens_generated, prompt_tokens,
                       suspended, resumed, duplicates, waiting, in_engine, admission_cap, paused_partitions,
                       time_to_first_token, end_to_end, inter_token):
            family.labels(cls)
        unauthenticated.labels(cls)
        for stage in STAGES:
            stage_seconds.labels(cls, stage)
        for outcome in OUTCOMES:
            requests_completed.labels(cls, outcome)
        for source in ("computed", "local_cache", "redis"):
            prefill_tokens.labels(cls, source)
    for code in ("invalid_request", "payload_too_large"):
        for route in ("reply", "dlq"):
            bad_records.labels(code, route)
    for op in ("stored", "loaded"):
        kv_pages.labels(op)
        kv_bytes.labels(op)
        for part in KV_SECONDS_PARTS[op]:
            kv_seconds.labels(op, part)
    for reason in PAGE_MISS_REASONS:
        kv_load_misses.labels(reason)
    for reason in ("over_budget", "dropped", "failed"):
        kv_save_failures.labels(reason)
    for kind in ("answer", "progress"):
        for reason in UNSEALABLE_REASONS:
            state_rejected.labels(kind, reason)
    for result in ("ok", "failed"):
        commits.labels(result)
