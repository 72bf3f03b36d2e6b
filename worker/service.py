"""Process wiring for `sluice worker`: engine, worker, ops server, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

import structlog

from topics import Catalog
from worker import preflight
from worker.engine import DeviceUnavailable, EngineDead
from worker.ops import OpsServer
from worker.settings import Settings
from worker.worker import GroupJoinTimeout, Worker

log = structlog.get_logger("sluice.service")


def run_loop(main):
    """Run `main` on uvloop when it is installed (it ships with vLLM's server extras): the worker's
    Kafka and Redis clients spend their time in the event loop, and uvloop's is faster."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def exit_after(seconds: float, exit=os._exit) -> threading.Timer:
    """Ends the process with status 1 unless cancelled within `seconds`.

    A thread, not a task: it fires even when the event loop is blocked or a step ignores
    cancellation, so a worker that stopped serving never stays up half-stopped.
    """

    def fire() -> None:
        try:  # the exit must not depend on logging still working this late
            log.error("shutdown_stuck", after_s=seconds, note="exiting 1 without finishing the shutdown")
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


# How long the engine's processes get to end on SIGTERM when the worker is stopped while it loads
LOADING_STOP_S = 5.0
# How long start-up checks cancelled by a stop get to close their clients
CHECKS_STOP_S = 2.0


async def _done_unless_stopped(task: asyncio.Future, stop: asyncio.Event) -> bool:
    """Wait for `task` or for `stop`, whichever comes first: whether `task` is done."""
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    return task.done()


async def _loaded_unless_stopped(load, stop: asyncio.Event, before_abandoning=None):
    """`load()` in a thread (vLLM's load and compile take a minute or more), unless SIGTERM comes first.

    A loading engine cannot be cancelled from here: its thread waits on the engine core process. So a
    stop ends the processes under this one and exits 0 at once (`abandon_loading`), rather than loading
    for a minute only to shut down: a terminal's Ctrl-C, or Kubernetes' SIGTERM to a pod still starting,
    would otherwise wait that long, and a grace period shorter than the load ends in SIGKILL.
    `before_abandoning()` is awaited first (the worker leaves a group it joined meanwhile)."""
    loading = asyncio.ensure_future(asyncio.to_thread(load))
    if not await _done_unless_stopped(loading, stop):
        if before_abandoning is not None:
            await before_abandoning()
        abandon_loading()
    return loading.result()


def abandon_loading() -> None:
    """End the processes under this one (SIGTERM, SIGKILL after LOADING_STOP_S), then exit 0."""
    from worker.engine_guard import end_descendants

    ended = end_descendants(LOADING_STOP_S)
    try:
        log.info("stopped_while_loading", ended_processes=len(ended), note="exiting 0 before the engine was ready")
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)  # not a return: the loading thread cannot be joined, and the interpreter would wait for it


async def _started_unless_stopped(worker: Worker, stop: asyncio.Event, on_stopping=None) -> bool:
    """Start the worker, unless SIGTERM comes first (a group join the coordinator holds can take up to
    SLUICE_GROUP_JOIN_S): then the start is cancelled, closing what it opened, within the same bound as a
    drain (`on_stopping`), and False is returned."""
    starting = asyncio.create_task(worker.start())
    if not await _done_unless_stopped(starting, stop):
        if on_stopping is not None:
            w = worker.settings.worker
            on_stopping(w.drain_grace_s + w.stop_margin_s)
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return False
    starting.result()
    return True


async def _listening(ops: OpsServer, settings: Settings) -> bool:
    """Start the ops server; False, said in one line, when it cannot listen (another process on the port,
    a host name this machine does not have)."""
    try:
        await ops.start()
        return True
    except OSError as exc:
        where = f"{settings.ops.metrics_host}:{settings.ops.metrics_port}"
        log.error("startup_refused", error=f"the ops server cannot listen on {where}: {exc.strerror or exc}")
        print(f"sluice: the ops server (/readyz, /metrics) cannot listen on {where} (SLUICE_METRICS_HOST, "
              f"SLUICE_METRICS_PORT): {exc.strerror or exc}", file=sys.stderr)
        return False


async def run_worker(settings: Settings, catalog: Catalog, engine=None, on_stopping=None, **clients) -> int:
    """The worker process: ops server, engine, worker; returns the exit code (0 drained, 1 failed).

    `on_stopping(deadline_s)` is called when the drain begins (`sluice worker` passes `exit_after`).
    `engine` and `clients` (consumer, producer, answers) replace the real ones in tests.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    worker: Worker | None = None

    def status():
        if worker is None or worker.engine is None:
            return False, {"engine": "loading"}
        return worker.health()

    ops = OpsServer(settings.ops.metrics_host, settings.ops.metrics_port, status)
    try:
        if not await _listening(ops, settings):
            return 1
        if not clients:  # the real clients: check their settings before minutes of engine loading
            if engine is None and settings.engine.engine_kind == "vllm":
                from worker.engine import detect_device

                detect_device(settings.engine.device)  # the device first: nothing else matters without it
            checking = asyncio.create_task(preflight.check(settings, catalog))
            if not await _done_unless_stopped(checking, stop):
                # a broker that does not answer holds a check up to its timeout (15 s): Ctrl-C does not wait
                checking.cancel()
                await asyncio.wait([checking], timeout=CHECKS_STOP_S)
                log.info("stopped_while_starting", during="start-up checks")
                return 0
            try:
                found = checking.result()
            except preflight.StartupError as exc:
                log.error("startup_refused", error=str(exc))
                print(f"sluice: {exc}", file=sys.stderr)
                return 1
            if found["redis"] != "ok":
                log.warning("redis_unreachable_at_start", note="serving degraded until it answers")
        if engine is None and settings.engine.engine_kind == "fake":
            from worker.fake_engine import FakeEngine

            log.warning("fake_engine", note="deterministic stand-in, not a model (SLUICE_ENGINE_KIND=fake)")
            engine = FakeEngine(settings.engine.max_model_len, token_delay_s=settings.engine.fake_token_ms / 1000)
        if engine is None:
            from worker.engine import VllmEngine

            log.info("engine_loading", model=settings.engine.model, device=settings.engine.device)
            worker = Worker(settings, catalog, None, **clients)
            if settings.group.join_early and not clients:
                worker.join_when_alone()  # the group's join passes during the load (worker/early_join.py)
            try:
                engine = await _loaded_unless_stopped(lambda: VllmEngine(settings), stop, worker.abandon)
            except DeviceUnavailable:
                await worker.abandon()
                raise
            except Exception as exc:  # noqa: BLE001 - a model that does not load, an engine core that died loading
                log.exception("engine_load_failed", model=settings.engine.model, error=repr(exc))
                print(f"sluice: the engine could not load {settings.engine.model}: {exc!r}", file=sys.stderr)
                await worker.abandon()
                return 1
            log.info("engine_ready", **engine.resolved)
            if settings.engine.ignore_eos:
                log.warning("ignore_eos", note="benchmark setting: every request runs to max_tokens (SLUICE_IGNORE_EOS)")
            worker.attach(engine)
        else:
            worker = Worker(settings, catalog, engine, **clients)
        try:
            if not await _started_unless_stopped(worker, stop, on_stopping):
                log.info("stopped_while_starting")
                return 0
        except Exception as exc:  # noqa: BLE001 - whichever client could not start: one clear line, exit 1
            hint = (" (if the broker has no idempotent producers, as the embedded one has not, set "
                    "SLUICE_KAFKA_IDEMPOTENCE=false)" if settings.kafka.idempotence
                    and not isinstance(exc, GroupJoinTimeout) else "")
            log.error("startup_failed", error=repr(exc))
            print(f"sluice: the worker's clients could not start: {exc!r}{hint}", file=sys.stderr)
            return 1
        rc = await worker.run_until(stop, on_stopping)
        if rc:
            log.error("worker_exiting", rc=rc, reason=worker.supervisor.failure)
        return rc
    except EngineDead:
        return 1
    except DeviceUnavailable as exc:
        log.error("device_unavailable", error=str(exc))
        return 1
    finally:
        if engine is not None:
            await engine.close()  # /readyz answers (503 after a failure) until the engine has ended
        await ops.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
