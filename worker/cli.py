"""The `sluice` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


def _settings(args):
    from worker.settings import SettingsError, load

    try:
        return load(getattr(args, "config", None))
    except SettingsError as exc:
        sys.exit(f"sluice: {exc}")


def _catalog(settings):
    import topics

    try:
        return topics.load(settings.worker.topics_file)
    except (OSError, ValueError) as exc:
        sys.exit(f"sluice: {exc}")


def cmd_dev(args) -> int:
    from worker import devstack

    state = Path(args.state_dir)
    try:
        if args.action == "up":
            devstack.up(state)
        elif args.action == "down":
            devstack.down(state)
        else:
            rows = devstack.status(state)
            for name, st in rows.items():
                print(f"{name:12s} {st}")
            return 0 if all(s.startswith("up") for s in rows.values()) else 1
    except devstack.DevStackError as exc:
        print(f"sluice dev {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_model(args) -> int:
    from worker.model import DEFAULT_DIR as SMOLLM2_DIR, ModelError, prepare
    from worker.model_mla import DEFAULT_DIR as MLA_DIR, prepare_mla

    try:
        if args.mla:
            prepare_mla(Path(args.out or MLA_DIR), force=args.force)
        else:
            prepare(Path(args.out or SMOLLM2_DIR), force=args.force)
    except ModelError as exc:
        print(f"sluice model prepare: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_topics(args) -> int:
    from aiokafka.errors import KafkaError

    from topics.admin import apply
    from topics.render import strimzi, with_profile

    settings = _settings(args)
    catalog = _catalog(settings)
    # render writes cluster resources (production by default); apply and check keep the file's values
    # unless told otherwise, so that `sluice topics apply` suits the one-node embedded broker
    catalog = with_profile(catalog, args.profile or ("production" if args.action == "render" else "dev"))
    if args.action == "render":
        text = strimzi(catalog, cluster=args.cluster)
        if args.out:
            Path(args.out).write_text(text)
        else:
            sys.stdout.write(text)
        return 0
    try:
        missing, drift = asyncio.run(apply(settings.kafka.options(), catalog, create=args.action == "apply"))
    except (KafkaError, OSError) as exc:
        print(f"sluice topics {args.action}: cannot reach {settings.kafka.bootstrap}: {exc!r}", file=sys.stderr)
        return 1
    for name in missing:
        print(f"{'created' if args.action == 'apply' else 'missing'}: {name}")
    for d in drift:
        print(f"drift: {d}")
    if not missing and not drift:
        print(f"ok: {len(catalog.topic)} topics match {settings.worker.topics_file or 'topics/default.toml'}"
              + (" with the production profile" if args.profile == "production" else ""))
    if args.action == "check":
        return 1 if missing or drift else 0
    return 1 if drift else 0


def cmd_keys(args) -> int:
    """A fresh random key, base64: an encryption key (the keys file) or a tenant's signing key."""
    from worker.sealing import CIPHERS, new_key

    print(new_key(args.cipher) if args.kind == "encryption" else new_key("aes-256-gcm"))
    if args.kind == "encryption":
        print(f"# {args.cipher}, {CIPHERS[args.cipher][1]} bytes: add it under [keys] in the keys file", file=sys.stderr)
    return 0


def cmd_schemas(args) -> int:
    from schemas.asyncapi import document, json_schemas

    if args.action == "asyncapi":
        settings = _settings(args)
        catalog = _catalog(settings)
        text = json.dumps(document(catalog, settings.kafka.bootstrap), indent=2) + "\n"
        if args.out:
            Path(args.out).write_text(text)
            print(args.out)
        else:
            sys.stdout.write(text)
        return 0
    out = Path(args.dir or "schemas/json")
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in json_schemas().items():
        (out / name).write_text(json.dumps(schema, indent=2) + "\n")
        print(out / name)
    return 0


def cmd_worker(args) -> int:
    from worker.logs import configure
    from worker.service import exit_after, run_loop, run_worker

    settings = _settings(args)
    catalog = _catalog(settings)
    try:
        catalog.serving(settings.worker.classes.split(","))
    except ValueError as exc:
        sys.exit(f"sluice: SLUICE_CLASSES={settings.worker.classes}: {exc}")
    configure(settings.ops.log_level, settings.ops.log_format)
    return run_loop(run_worker(settings, catalog, on_stopping=exit_after))


def _signer(args):
    from schemas.signing import Signer

    try:
        return Signer.from_key_file(args.tenant, args.signing_key_file, args.key_id)
    except ValueError as exc:
        sys.exit(f"sluice: {exc}")


def _tenant_args(p) -> None:
    p.add_argument("--tenant", help="publish as this tenant: its dedicated request topics (tenancy_mode topic)")
    p.add_argument("--signing-key-file", help="sign records with this tenant key (base64 in the file; "
                   "tenancy_mode signed)")
    p.add_argument("--key-id", default="k1", help="the key's id in the tenants file")


def cmd_loadgen(args) -> int:
    from loadgen.run import run, write_reports
    from loadgen.workload import Workload, parse_mix

    settings = _settings(args)
    catalog = _catalog(settings)
    try:
        workload = Workload(rate=args.rate, seconds=args.seconds, arrival=args.arrival, mix=parse_mix(args.mix),
                            max_tokens=(args.min_tokens, args.max_tokens), seed=args.seed)
    except ValueError as exc:
        sys.exit(f"sluice loadgen: {exc}")
    timings = asyncio.run(run(settings.kafka.options(), catalog, workload, signer=_signer(args)))
    write_reports(timings, workload, Path(args.out))
    print((Path(args.out) / "loadgen.md").read_text())
    print(f"wrote {args.out}/loadgen.json, loadgen.png, loadgen.md")
    return 0


def cmd_ask(args) -> int:
    import uuid

    from loadgen.ask import ask, summary

    settings = _settings(args)
    catalog = _catalog(settings)
    signer = _signer(args)
    body: dict = {"id": args.id or f"ask-{uuid.uuid4().hex[:12]}", "stream": not args.no_stream}
    if args.template:
        try:
            event = json.loads(args.event or "{}")
        except ValueError as exc:
            sys.exit(f"sluice ask: --event is not JSON: {exc}")
        body.update(kind="score", template=args.template, event=event)
        if args.labels:
            body["labels"] = args.labels.split(",")
    elif args.prompt is None:
        sys.exit("sluice ask: give a PROMPT, or --template and --event for a score request")
    elif args.chat:
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        body["prompt"] = args.prompt
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    request_topic = catalog.request_topic(args.latency_class, signer.tenant).name
    streamed = []

    def on_token(reply):
        streamed.append(reply)
        if not args.json:
            print(reply.text, end="", flush=True)

    from aiokafka.errors import KafkaError

    from loadgen.ask import NO_BROKER

    try:
        answer = asyncio.run(ask(settings.kafka.options(), request_topic, catalog.replies.name, body, args.timeout_s,
                                 headers=signer.headers if signer.secret is not None else None, on_token=on_token))
    except KeyboardInterrupt:  # Ctrl-C while waiting: the request stays published and may still be answered
        print(f"\nsluice ask: stopped waiting for {body['id']}", file=sys.stderr)
        return 130
    except LookupError as exc:  # the reply topic is not there: nothing could be read
        print(f"sluice ask: {exc}", file=sys.stderr)
        return NO_BROKER
    except KafkaError as exc:
        print(f"sluice ask: the broker at {settings.kafka.bootstrap} did not take the request: {exc}", file=sys.stderr)
        return NO_BROKER
    if args.json:
        import msgspec

        print(msgspec.json.encode(answer.final).decode() if answer.final is not None else "null")
    else:
        if answer.final is not None and not streamed and getattr(answer.final, "text", ""):
            print(answer.final.text, end="")
        if streamed or getattr(answer.final, "text", ""):
            print()
    print(summary(answer, request_topic, args.timeout_s), file=sys.stderr)
    return answer.status


def cmd_backfill(args) -> int:
    import signal
    import time

    from tqdm import tqdm

    from aiokafka.errors import KafkaError

    from worker.backfill import (Backfill, DeadLettered, Job, JobRunning, OutputUnreadable, RequestRefused,
                                 render_summary)
    from worker.backfill_stall import Stalled
    from worker.backfill_range import RangeError, SourceChanged, parse_bound
    from worker.job_lease import LeaseHeld, LeaseLost, LeaseUnavailable
    from worker.progress_lines import LineProgress

    settings = _settings(args)
    catalog = _catalog(settings)
    try:
        first, last = parse_bound(args.start), parse_bound(args.stop)
    except RangeError as exc:
        sys.exit(f"sluice backfill: {exc}")
    if first is not None and last is not None and type(first) is type(last) and first > last:
        sys.exit(f"sluice backfill: --from {args.start} is after --to {args.stop}: the range would hold no event")
    if args.stall_s < 0:
        sys.exit(f"sluice backfill: --stall-s {args.stall_s:g}: seconds to wait for a reply, or 0 to wait for ever")
    if args.lease_s < 1:
        sys.exit(f"sluice backfill: --lease-s {args.lease_s:g}: a lease needs at least 1 s to be renewed in time")
    if args.out == args.source or catalog.by_name(args.out) is not None:
        # results in a request topic would be read as requests; in the reply topic, pose as replies
        what = "the source" if args.out == args.source else "a topic of the workers (topics file)"
        sys.exit(f"sluice backfill: --out {args.out} is {what}: results need a topic of their own")
    job = Job(source=args.source, out=args.out, template=args.template, start=args.start, stop=args.stop,
              labels=tuple(args.labels.split(",")) if args.labels else None, max_tokens=args.max_tokens,
              name=args.name)

    def progress(total, initial):
        if not sys.stderr.isatty():  # a pod's log or a file: whole lines, not a bar redrawn in one line
            return LineProgress(total, initial, desc=f"backfill {job.id}")
        return tqdm(total=total, initial=initial, desc=f"backfill {job.id}", unit="ev", mininterval=1,
                    dynamic_ncols=True)

    async def go():
        bf = Backfill(settings, catalog, job, state_dir=args.state_dir, max_in_flight=args.max_in_flight,
                      latency_class=args.latency_class, progress=progress, signer=_signer(args),
                      lease=not args.no_lease, lease_s=args.lease_s, stall_s=args.stall_s)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, bf.stop.set)
        t0 = time.monotonic()
        cp = await bf.run()
        return bf, cp, time.monotonic() - t0

    try:
        bf, cp, seconds = asyncio.run(go())
    except (RangeError, JobRunning, LeaseHeld, LeaseLost, LeaseUnavailable, DeadLettered, Stalled,
            RequestRefused, SourceChanged, OutputUnreadable) as exc:
        sys.exit(f"sluice backfill: {exc}")
    except KafkaError as exc:  # one line naming the broker, not a traceback; what was done is checkpointed
        sys.exit(f"sluice backfill: Kafka at {settings.kafka.bootstrap}: {exc}; "
                 "once it answers, the same command starts the job or continues it from its checkpoint")
    if not cp.complete:
        print(render_summary(bf.counts(cp), seconds))
        print(f"stopped; checkpoint in {bf.path}. Run the same command to resume.")
        return 130
    print(render_summary(cp, cp.seconds))
    print(f"done: results in {job.out}; checkpoint {bf.path}")
    return 0


def cmd_dlq(args) -> int:
    from aiokafka.errors import KafkaError

    from worker.backfill_range import RangeError
    from worker.dead_letters import ListingBroken, read, replay

    if args.limit < 0:
        sys.exit(f"sluice dlq: --limit {args.limit}: a count of dead letters to show, or 0 for all")
    settings = _settings(args)
    catalog = _catalog(settings)
    topic = catalog.dlq.name
    try:
        show = args.action == "show"
        count, letters, removed = asyncio.run(read(settings.kafka.options(), topic, args.since, args.code,
                                                   last=(args.limit or None) if show else None))
        if removed:
            print(f"{removed} dead letters were removed by {topic}'s retention while they were read: not listed")
        if show:
            for letter in letters:
                print(letter.line())
            print(f"{count} dead letters in {topic}" + (f" since {args.since}" if args.since else "")
                  + (f" with code {args.code}" if args.code else "")
                  + (f"; the last {len(letters)} shown" if len(letters) < count else ""))
            return 0
        sent, skipped = asyncio.run(replay(settings.kafka.options(), letters, {t.name for t in catalog.requests},
                                           dry_run=args.dry_run))
    except (RangeError, ListingBroken) as exc:
        sys.exit(f"sluice dlq: {exc}")
    except KafkaError as exc:
        sys.exit(f"sluice dlq: Kafka at {settings.kafka.bootstrap}: {exc!r}")
    for letter, why in skipped:
        print(f"skipped {letter.partition}:{letter.offset} ({why})")
    print(f"{'would publish' if args.dry_run else 'published'} {len(sent)} dead letters again to their request "
          f"topics; skipped {len(skipped)}")
    return 0


def cmd_chaos(args) -> int:
    from tqdm import tqdm

    from loadgen.chaos import report
    from loadgen.chaos.faults import FaultError
    from loadgen.chaos.run import Run, Scenario

    settings = _settings(args)
    sc = Scenario(engine=args.engine, requests=args.requests, fuzz=args.fuzz, rate=args.rate, workers=args.workers,
                  faults=args.faults, seed=args.seed, token_ms=args.token_ms,
                  max_tokens=(args.min_tokens, args.max_tokens), settle_s=args.settle_s,
                  dev_dir=Path(args.dev_dir), out=Path(args.out))
    bar = tqdm(total=sc.requests + sc.fuzz, desc="chaos", unit="rec", mininterval=1, dynamic_ncols=True)

    def progress(run, pool):
        bar.n = len(run.audit.record_ids) - run.audit.pending()
        last = pool.events[-1] if pool.events else ("", "", "")
        bar.set_postfix(sent=len(run.audit.record_ids), in_flight=run.series[-1]["in_flight"],
                        workers=len(pool.alive()), last=f"{last[1]} {last[2]}"[:28], refresh=False)
        bar.refresh()

    try:
        result = asyncio.run(Run(sc, settings, progress).main())
    except (FaultError, RuntimeError) as exc:
        bar.close()
        print(f"sluice chaos: {exc}", file=sys.stderr)
        return 2
    bar.close()
    paths = report.write(result, sc.out / result["run"])
    print(report.markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 1 if result["failed"] else 0


def cmd_demo(args) -> int:
    from loadgen.demo import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    from worker import devstack
    from worker.backfill_stall import STALL_S
    from worker.job_lease import LEASE_S

    parser = argparse.ArgumentParser(prog="sluice", description="Kafka-fed streaming LLM inference on vLLM")
    parser.add_argument("--config", help="settings TOML file (default: $SLUICE_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("dev", help="embedded broker + Redis Cluster on loopback")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--state-dir", default=str(devstack.DEFAULT_DIR))
    p.set_defaults(fn=cmd_dev)

    p = sub.add_parser("model", help="prepare the bundled SmolLM2-135M-Instruct (or a tiny MLA model) for vLLM")
    p.add_argument("action", choices=["prepare"])
    p.add_argument("--out", default=None, help="default .sluice/models/<model>")
    p.add_argument("--mla", action="store_true",
                   help="a tiny random-weight DeepSeek-V2-style model (MLA attention), for KV page tests")
    p.add_argument("--force", action="store_true", help="rebuild even if the cached copy verifies")
    p.set_defaults(fn=cmd_model)

    p = sub.add_parser("topics", help="create missing topics / check for drift / render Strimzi KafkaTopics")
    p.add_argument("action", choices=["apply", "check", "render"])
    p.add_argument("--format", choices=["strimzi"], default="strimzi", help="render: the resource kind")
    p.add_argument("--profile", choices=["dev", "production"], default=None,
                   help="production: 3 replicas, min.insync.replicas 2 (the default of render); dev: the topics "
                        "file's own values (the default of apply and check)")
    p.add_argument("--cluster", default="sluice", help="render: the Strimzi Kafka cluster (strimzi.io/cluster)")
    p.add_argument("--out", help="render: write here instead of stdout")
    p.set_defaults(fn=cmd_topics)

    p = sub.add_parser("schemas", help="the wire contract: JSON Schemas (export DIR) or an AsyncAPI 3.0 document")
    p.add_argument("action", choices=["export", "asyncapi"])
    p.add_argument("dir", nargs="?", help="export: the folder to write (default schemas/json)")
    p.add_argument("--out", help="asyncapi: write here instead of stdout")
    p.set_defaults(fn=cmd_schemas)

    p = sub.add_parser("keys", help="print a new random key (base64): for the encryption keys file or a tenant")
    p.add_argument("kind", choices=["encryption", "signing"])
    p.add_argument("--cipher", choices=["aes-256-gcm", "sm4-gcm"], default="aes-256-gcm")
    p.set_defaults(fn=cmd_keys)

    p = sub.add_parser("worker", help="run a worker")
    p.set_defaults(fn=cmd_worker)

    p = sub.add_parser("loadgen", help="open-loop load against running workers; JSON, PNG and markdown report")
    p.add_argument("--rate", type=float, default=5.0, help="requests per second")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    p.add_argument("--mix", default="realtime=0.3,standard=0.4,batch=0.3")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default="out/loadgen")
    _tenant_args(p)
    p.set_defaults(fn=cmd_loadgen)

    p = sub.add_parser("ask", help="one request through the running workers, its reply shown as it comes; "
                                   "exit 0 done, 1 error reply, 2 no reply in time, 3 broker unreachable")
    p.add_argument("prompt", nargs="?", help="the prompt (a generate request)")
    p.add_argument("--class", dest="latency_class", default="realtime", choices=["realtime", "standard", "batch"])
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message (the chat template)")
    p.add_argument("--max-tokens", type=int, help="default: the workers' default_max_tokens")
    p.add_argument("--no-stream", action="store_true", help="ask for the done only, no token records")
    p.add_argument("--template", help="a score request through this template (with --event)")
    p.add_argument("--event", help="the event to score, as JSON")
    p.add_argument("--labels", help="comma-separated labels (default: the template's)")
    p.add_argument("--id", help="the request id (default: a fresh one; an id already answered is answered "
                                "again from its stored answer)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="how long to wait for the final reply")
    p.add_argument("--json", action="store_true", help="print the final reply as JSON (for scripts), no tokens")
    _tenant_args(p)
    p.set_defaults(fn=cmd_ask)

    p = sub.add_parser("backfill", help="score a topic range through the batch class; resumable, one result per event")
    p.add_argument("--source", required=True, help="topic holding the events")
    p.add_argument("--from", dest="start", default=None, help="first offset or ISO time (default: the beginning)")
    p.add_argument("--to", dest="stop", default=None,
                   help="offset or ISO time where the range ends, not included (default: the end at the first run)")
    p.add_argument("--template", required=True, help="score template name (see schemas/prompts)")
    p.add_argument("--out", required=True, help="topic for the results, keyed by event id")
    p.add_argument("--labels", help="comma-separated labels (default: the template's)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens of generated rationale per event (default 0)")
    p.add_argument("--name", help="job name (default: derived from the arguments); names the checkpoint")
    p.add_argument("--state-dir", default=".sluice/backfill", help="where checkpoints live")
    p.add_argument("--no-lease", action="store_true",
                   help="run without the job's lease in Redis, which keeps a second run on another machine out; "
                        "only where Redis cannot be reached and no other machine runs this job")
    p.add_argument("--lease-s", type=float, default=LEASE_S,
                   help="how long the job's lease outlives a run that stops without releasing it (killed), and how "
                        f"long a run may go without renewing it before it stops writing (default {LEASE_S:g})")
    p.add_argument("--stall-s", type=float, default=STALL_S,
                   help="stop (exit 1, checkpoint kept) when requests are out and none is answered for this long: "
                        f"no worker reads the topic, or the tenant's limits refuse them all (default {STALL_S:g}; "
                        "0 waits for ever)")
    p.add_argument("--max-in-flight", type=int, default=512)
    p.add_argument("--class", dest="latency_class", default="batch", choices=["realtime", "standard", "batch"])
    _tenant_args(p)
    p.set_defaults(fn=cmd_backfill)

    p = sub.add_parser("dlq", help="dead letters: show them, or publish them again to their request topic once "
                                   "the cause is fixed")
    p.add_argument("action", choices=["show", "replay"])
    p.add_argument("--since", help="ISO time, or an offset in every partition (default: the beginning)")
    p.add_argument("--code", help="only dead letters with this error code")
    p.add_argument("--limit", type=int, default=50, help="show: the newest N (0: all)")
    p.add_argument("--dry-run", action="store_true", help="replay: say what would be published, publish nothing")
    p.set_defaults(fn=cmd_dlq)

    p = sub.add_parser("chaos", help="seeded workload, fuzzed records and faults against worker processes; audited")
    p.add_argument("--engine", choices=["fake", "vllm"], default="fake",
                   help="fake: deterministic stand-in engine, for scale; vllm: the real engine and model")
    p.add_argument("--requests", type=int, default=10_000, help="valid requests")
    p.add_argument("--fuzz", type=int, default=2_000, help="hostile and malformed records interleaved")
    p.add_argument("--rate", type=float, default=60.0, help="valid requests per second")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--faults", default="kill,join,pause,kill,redis,leave,broker,kill",
                   help="comma-separated, spread over the run: kill, pause, join, leave, redis, broker ('' for none)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--token-ms", type=int, default=20, help="fake engine: milliseconds per generated token")
    p.add_argument("--min-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--settle-s", type=float, default=300.0, help="how long answers may take after the last send")
    p.add_argument("--dev-dir", default=str(devstack.DEFAULT_DIR), help="the embedded stack's state (for its pids)")
    p.add_argument("--out", default="out/chaos")
    p.set_defaults(fn=cmd_chaos)

    p = sub.add_parser("demo", help="embedded stack + worker + a burst of requests, results shown")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--keep-up", action="store_true", help="leave the embedded stack running afterwards")
    p.set_defaults(fn=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
