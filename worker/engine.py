"""The engine seam: a small Protocol, and the vLLM adapter (the only code that imports vllm)."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from schemas import Request
from worker.engine_guard import EngineGuard
from worker.prompt_tokens import check_chat_template, encode_chat, encode_text, tokenizer_fingerprint


@dataclass(frozen=True, slots=True)
class GenParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Score requests: log-probabilities of these token ids at the first generated position.
    logprob_token_ids: tuple[int, ...] = ()
    # KV pages in Redis: whose pages these are (None: no lookup, no save), and whether to save
    tenant: str | None = None
    save_pages: bool = False


@dataclass(frozen=True, slots=True)
class Delta:
    """New tokens since the last delta; `finish_reason` is set on the last one.

    `logprobs` holds the requested `logprob_token_ids` at the first position of this delta.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: dict[int, float] | None = None
    # on the last delta: prompt tokens served from the local prefix cache and loaded from Redis
    cached_tokens: int = 0
    kv: dict | None = None


class EngineDead(RuntimeError):
    """The engine cannot serve any more requests; the worker must stop."""


class EngineUnanswered(RuntimeError):
    """An idle engine's own process did not answer a round trip in time (frozen, or hung)."""


class Engine(Protocol):
    max_model_len: int
    tokenizer_id: str  # what its token ids mean (`prompt_tokens.tokenizer_fingerprint`)

    def prompt_ids(self, request: Request) -> list[int]: ...

    def render_ids(self, text: str, chat: bool, system: str | None) -> list[int]: ...

    def label_ids(self, labels: list[str], chat: bool) -> list[list[int]]: ...

    def text_ids(self, text: str) -> list[int]: ...

    def generate(self, request_id: str, prompt_ids: list[int], params: GenParams, priority: int) -> AsyncIterator[Delta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self, timeout_s: float) -> None:
        """Raise when the engine cannot serve: dead, or (idle) not answering within `timeout_s`."""
        ...

    def cpu_times(self) -> dict[int, float] | None:
        """While the engine holds requests, the CPU seconds each of its processes has used so far
        (`worker/engine_frozen.py`); None while it holds none, or when it has no processes of its own."""
        ...

    def shutdown(self) -> None: ...

    async def close(self) -> None:
        """`shutdown()` without holding the event loop (the worker's /readyz still answers meanwhile)."""
        ...


def kv_connector_config(settings, fingerprint: str) -> dict:
    """The connector's `kv_connector_extra_config`: the settings sections it needs, as plain data
    (vLLM hands it to the connector in its own processes, which rebuild the same Structs)."""
    import msgspec

    return {"redis": msgspec.to_builtins(settings.redis), "kv": msgspec.to_builtins(settings.kv),
            "fingerprint": fingerprint}


def engine_args(config, dtype: str) -> dict:
    """vLLM engine arguments from the `engine` settings (everything but the KV connector): one place,
    so every process and benchmark arm that builds an engine from settings gets the same ones."""
    args = dict(model=config.model, dtype=dtype, max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                scheduling_policy="priority", enable_prefix_caching=config.enable_prefix_caching,
                gpu_memory_utilization=config.gpu_memory_utilization, disable_log_stats=True,
                tensor_parallel_size=config.tensor_parallel_size, pipeline_parallel_size=config.pipeline_parallel_size,
                kv_cache_dtype=config.kv_cache_dtype)
    if config.quantization is not None:
        args["quantization"] = config.quantization
    if config.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.compile_mode == "eager":
        args["enforce_eager"] = True
    return args


ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def describe_config(vllm_config) -> dict:
    """The engine configuration vLLM resolved (after its defaults for the device), as plain data:
    logged at start-up, and what benchmark arms compare before their ratios mean anything."""
    model, sched, cache = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
    executor = vllm_config.parallel_config.distributed_executor_backend  # "mp", or a class (`inprocess`)
    return {"dtype": str(model.dtype).removeprefix("torch."), "max_model_len": model.max_model_len,
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "chunked_prefill": bool(sched.enable_chunked_prefill), "scheduling_policy": str(sched.policy),
            "prefix_caching": bool(cache.enable_prefix_caching), "block_size": cache.block_size,
            "kv_cache_dtype": str(cache.cache_dtype), "enforce_eager": bool(model.enforce_eager),
            "executor": executor if isinstance(executor, str) or executor is None else executor.__name__,
            "kv_connector": (vllm_config.kv_transfer_config.kv_connector
                             if vllm_config.kv_transfer_config is not None else None),
            # not vLLM's, but the engine's processes inherit it from here (`engine_env`)
            "onednn_cache": os.environ.get(ONEDNN_CACHE_ENV, "default")}


def engine_env(config) -> dict[str, str]:
    """Environment for the engine's processes (they inherit it when spawned): the compile mode, and
    oneDNN's primitive cache, which its library reads once as it loads in the engine core."""
    env = {"VLLM_USE_AOT_COMPILE": "0"} if config.compile_mode == "graph-cache" else {}
    if config.onednn_cache_capacity is not None:
        env[ONEDNN_CACHE_ENV] = str(config.onednn_cache_capacity)
    return env


_WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf"})
_SAMPLE_BYTES, _SAMPLES = 1 << 16, 18


def weights_digest(root) -> bytes:
    """Names a model directory's weights without reading them all: each weight file's path, size and
    18 blocks of 64 KiB (its first, its last and 16 evenly between).

    A fine-tune keeps its base model's config.json, and nearly every block of its weights differs;
    reading every byte of a 16 GB model at each start would cost a restart tens of seconds."""
    import hashlib
    from pathlib import Path

    root = Path(root)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
        size = f.stat().st_size
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + str(size).encode() + b"\0")
        with f.open("rb") as fh:
            span = max(0, size - _SAMPLE_BYTES)
            for at in dict.fromkeys(k * span // (_SAMPLES - 1) for k in range(_SAMPLES)):
                fh.seek(at)
                h.update(fh.read(_SAMPLE_BYTES))
    return h.digest()


@functools.cache
def model_fingerprint(model: str, dtype: str, kv_cache_dtype: str = "auto") -> str:
    """Names the weights and the KV layout, so pages of another model, fine-tune, dtype or cache dtype
    never match: a worker rolled to new weights must not continue from the old weights' pages."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256(dtype.encode() + (b"" if kv_cache_dtype == "auto" else b"/kv=" + kv_cache_dtype.encode()))
    root = Path(model)
    for name in ("sluice-manifest.json", "config.json"):
        if (root / name).is_file():
            h.update((root / name).read_bytes())
    if (root / "config.json").is_file():
        h.update(weights_digest(root))
    else:
        h.update(model.encode())  # a hub id: the name is all we have
    return h.hexdigest()[:32]


def _run_model_in_engine_core(vllm_config, forkserver_env: dict[str, str]) -> None:
    """`SLUICE_ENGINE_START=inprocess`: the engine core, forked from a forkserver that started with
    `forkserver_env`, runs the model itself (vLLM's one-process executor) when that is the binding
    and preload vLLM would give its model runner; otherwise the runner starts vLLM's way."""
    import structlog

    from worker import engine_fork, omp_binding

    log = structlog.get_logger("sluice.engine")
    wanted = omp_binding.expected(vllm_config)
    if wanted != forkserver_env:
        # the engine core must not keep the forkserver's binding while its runner computes elsewhere
        engine_fork.ENGINE_CORE_AFFINITY.update(os.sched_getaffinity(0))
        log.warning("model_runner_spawned", reason="the OpenMP binding vLLM chose differs from the predicted one",
                    predicted=forkserver_env, chosen=wanted)
        return
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    # a class, not "uni": vLLM's CPU platform turns "uni" into "mp" because it cannot set OpenMP up
    # in a running process; here the process started with it
    vllm_config.parallel_config.distributed_executor_backend = UniProcExecutor
    engine_fork.ENGINE_CORE_ENV.update({k: v for k, v in forkserver_env.items() if k in omp_binding.OMP_KEYS})
    log.info("model_runner_in_engine_core", binding={k: v for k, v in forkserver_env.items() if k != "LD_PRELOAD"})


class DeviceUnavailable(RuntimeError):
    """The device `SLUICE_DEVICE` asks for is not there; the message names what is missing."""


def detect_device(requested: str) -> str:
    """The device to run on: the one asked for (checked), or with `auto` the first one present."""
    if requested == "cpu":
        return "cpu"
    try:
        import torch
    except ImportError:
        if requested == "auto":
            return "cpu"
        raise DeviceUnavailable(f"SLUICE_DEVICE={requested}, but PyTorch is not installed: "
                                f"run `deploy/install.sh .venv {requested}`") from None
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda"
    if requested == "cuda":
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none (a CPU-only torch)'}"
        raise DeviceUnavailable(f"SLUICE_DEVICE=cuda, but PyTorch sees no CUDA device ({build}): install the "
                                "cuda extra (`deploy/install.sh .venv cuda`) and check the NVIDIA driver (`nvidia-smi`)")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        if requested == "npu":
            raise DeviceUnavailable("SLUICE_DEVICE=npu, but torch-npu is not installed: install the npu extra "
                                    "(`deploy/install.sh .venv npu`) on a host with Ascend's CANN toolkit") from None
        return "cpu"
    if torch.npu.is_available():  # type: ignore[attr-defined]
        return "npu"
    if requested == "npu":
        raise DeviceUnavailable("SLUICE_DEVICE=npu, but torch-npu sees no Ascend NPU: check the driver and "
                                "CANN environment (`npu-smi info`, `source set_env.sh`)")
    return "cpu"


def amx_mla_cannot_take(model_config, amx=None) -> bool:
    """A multi-head latent attention model in float32 on a CPU with AMX tiles: vLLM would pick its
    AMX MLA backend, whose weight packing refuses float32 ("expect weight to be bfloat16, ...")."""
    if not getattr(model_config, "use_mla", False) or str(model_config.dtype) != "torch.float32":
        return False
    if amx is None:
        import platform

        import torch

        amx = platform.machine() == "x86_64" and torch.cpu._is_amx_tile_supported()
    return amx


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are only fast on CPUs with AVX512-BF16 or AMX; elsewhere float32 is several times faster."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(requested: str, device: str) -> str:
    if requested != "auto":
        return requested
    if device == "cpu":
        return "bfloat16" if cpu_has_fast_bf16() else "float32"
    return "auto"  # the model's own dtype on GPU / NPU


class VllmEngine:
    """vLLM `AsyncLLM` with token-id prompts, delta outputs and priority scheduling."""

    def __init__(self, settings):
        """`settings`: the whole settings tree; the engine reads `engine`, and `kv` + `redis` for pages."""
        self.config = config = settings.engine
        self.device = detect_device(config.device)
        if self.device == "cpu":
            # Read by vLLM's CPU worker when the engine core starts.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kvcache_gib))
        os.environ.update(engine_env(config))  # read by vLLM in this process and the engine core it starts
        inprocess_env = None  # the binding the forkserver starts with, when the engine core is to run the model
        if self.device == "cpu" and config.engine_start in ("inprocess", "forkserver"):
            from worker import engine_fork, omp_binding

            if config.engine_start == "inprocess" and config.tensor_parallel_size == config.pipeline_parallel_size == 1:
                inprocess_env = omp_binding.predict(dict(os.environ), kv_connector=settings.kv.pages)
            engine_fork.start_forkserver(engine_fork.PRELOAD_INPROCESS if inprocess_env else engine_fork.PRELOAD,
                                         env=inprocess_env)
            engine_fork.use_forkserver_for_engine_core()
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        self._SamplingParams = SamplingParams
        self._delta = RequestOutputKind.DELTA
        dtype = resolve_dtype(config.dtype, self.device)
        kv_transfer = None
        if settings.kv.pages:
            from vllm.config import KVTransferConfig

            extra = kv_connector_config(settings, model_fingerprint(config.model, dtype, config.kv_cache_dtype))
            kv_transfer = KVTransferConfig(kv_connector="SluiceKVConnector", kv_connector_module_path="worker.kv_connector",
                                           kv_role="kv_both", kv_load_failure_policy="recompute",
                                           kv_connector_extra_config=extra)
        self.kv_enabled = kv_transfer is not None
        args = AsyncEngineArgs(**engine_args(config, dtype), kv_transfer_config=kv_transfer)
        from vllm.usage.usage_lib import UsageContext

        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        if self.device == "cpu" and amx_mla_cannot_take(vllm_config.model_config):
            # vLLM prefers its AMX MLA kernels where the CPU has AMX, and they take 16-bit weights only:
            # a float32 MLA model would fail to load there, so it runs on vLLM's reference CPU MLA backend
            args.attention_backend = "CPU_MLA"
            vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        if inprocess_env is not None:
            _run_model_in_engine_core(vllm_config, inprocess_env)
        self.guard = EngineGuard()
        self.guard.before()  # from here, a worker killed while the engine loads takes what it started with it
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        # vLLM's engine metrics (vllm:*) in the process registry, served on the worker's /metrics;
        # its periodic log lines stay off (disable_log_stats). `_StepLogger` hands each step's tokens
        # to admission "step" (`watch_steps`).
        self._on_step = None
        try:
            self._llm = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[PrometheusStatLogger, self._step_logger],
                                                  enable_log_requests=args.enable_log_requests,
                                                  disable_log_stats=args.disable_log_stats)
        except BaseException:
            self.guard.close()  # whatever the failed start left running is ended
            raise
        self.guard.watch()  # a SIGKILLed worker must not leave the engine processes running
        self._tokenizer = self._llm.get_tokenizer()
        check_chat_template(self._tokenizer)
        self.tokenizer_id = tokenizer_fingerprint(self._tokenizer)
        self.max_model_len = self._llm.model_config.max_model_len
        self.resolved = describe_config(self._llm.vllm_config)

    def _step_logger(self, vllm_config, engine_index: int = 0):
        """vLLM's per-step stats callback: called once per engine step the front process receives."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _StepLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if iteration_stats is not None and engine._on_step is not None:
                    engine._on_step(iteration_stats.num_generation_tokens, iteration_stats.num_prompt_tokens)

            def log_engine_initialized(self):
                pass

        return _StepLogger(vllm_config, engine_index)

    def watch_steps(self, listener) -> None:
        """Call `listener(tokens, prompt_tokens)` for each engine step: the tokens it decoded, and the
        prompt tokens of the requests whose first token it produced (their prefill)."""
        self._on_step = listener

    def prompt_ids(self, request: Request) -> list[int]:
        """Producer text never becomes control tokens (`worker/prompt_tokens.py`)."""
        if request.messages is not None:
            return encode_chat(self._tokenizer, [{"role": m.role, "content": m.content} for m in request.messages])
        return encode_text(self._tokenizer, request.prompt or "")

    def render_ids(self, text: str, chat: bool, system: str | None) -> list[int]:
        """A template's rendered text as prompt ids: a chat turn (with optional system) or plain text.
        Rendered event fields are producer text: tokenized as such."""
        if not chat:
            return encode_text(self._tokenizer, text)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return encode_chat(self._tokenizer, messages)

    def label_ids(self, labels: list[str], chat: bool) -> list[list[int]]:
        """Each label's tokens as the model would write them right after the prompt."""
        # After a chat prompt the answer starts a fresh turn; after plain text it follows a space.
        return [encode_text(self._tokenizer, label if chat else " " + label, add_special_tokens=False)
                for label in labels]

    def text_ids(self, text: str) -> list[int]:
        """Generated text as this tokenizer writes it, to continue after (no BOS: it follows the prompt)."""
        return encode_text(self._tokenizer, text, add_special_tokens=False)

    def sampling_params(self, params: GenParams):
        return self._SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=list(params.stop) or None,
            ignore_eos=self.config.ignore_eos,
            output_kind=self._delta,
            logprob_token_ids=list(params.logprob_token_ids) or None,
            extra_args=({"kv_transfer_params": {"sluice": {"tenant": params.tenant, "save": params.save_pages}}}
                        if self.kv_enabled and params.tenant is not None else None),
        )

    async def generate(self, request_id, prompt_ids, params, priority) -> AsyncIterator[Delta]:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            async for out in self._llm.generate(
                # per-tenant salt: vLLM's local prefix cache never serves one tenant's prefix to another
                # (time to first token would tell whether another tenant sent the same prompt)
                TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=f"sluice:{params.tenant}")
                if params.tenant is not None else TokensPrompt(prompt_token_ids=prompt_ids),
                self.sampling_params(params),
                request_id,
                priority=priority,
            ):
                completion = out.outputs[0]
                logprobs = None
                if params.logprob_token_ids and completion.logprobs:
                    first = completion.logprobs[0]
                    logprobs = {t: first[t].logprob for t in params.logprob_token_ids if t in first}
                if out.finished:
                    kv = (out.kv_transfer_params or {}).get("sluice")
                    yield Delta(completion.text, list(completion.token_ids), completion.finish_reason, logprobs,
                                out.num_cached_tokens or 0, kv)
                else:
                    yield Delta(completion.text, list(completion.token_ids), None, logprobs)
        except EngineDeadError as exc:
            raise EngineDead(str(exc)) from exc

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def check_health(self, timeout_s: float) -> None:
        """vLLM's own check reads a flag set when its engine core dies: a frozen or hung engine core
        passes it, and an idle worker looked ready until its first request waited out the stall
        bound (by hand: 120 s, then drain and exit). So an idle engine is also asked a round trip to
        its engine core. A busy one is not: one step may take longer than `timeout_s` there
        (a long prefill on CPU), and the stall check covers it."""
        await self._llm.check_health()
        if self._busy():
            return
        try:
            async with asyncio.timeout(timeout_s):
                await self._llm.is_sleeping()  # a utility call: answered by the engine core between steps
        except TimeoutError:
            if not self._busy():  # work that came meanwhile waits one step: the stall check's to judge
                raise EngineUnanswered(f"the idle engine core did not answer a round trip within {timeout_s:g} s "
                                       f"(frozen or hung)") from None

    def _busy(self) -> bool:
        return self._llm.output_processor.has_unfinished_requests()

    def cpu_times(self) -> dict[int, float] | None:
        return self.guard.cpu_times() if self._busy() else None

    async def reset_prefix_cache(self) -> None:
        """Forget the local prefix cache (tests and benchmarks: force a lookup in Redis)."""
        await self._llm.reset_prefix_cache()

    @property
    def block_size(self) -> int:
        return self._llm.vllm_config.cache_config.block_size

    @property
    def fingerprint(self) -> str:
        return model_fingerprint(self.config.model, resolve_dtype(self.config.dtype, self.device),
                                 self.config.kv_cache_dtype)

    def unfinished(self) -> int:
        """Requests the engine still holds (running or waiting)."""
        return self._llm.output_processor.get_num_unfinished_requests()

    async def close(self) -> None:
        """vLLM's shutdown waits for its engine core to exit, which a frozen one never does until it is
        killed, and on the event loop that wait had /readyz unanswered (after a failure's 503) until the
        worker gave up. So it runs in a thread, once the one task that reads the engine's output socket
        on the loop has ended: zmq sockets are not to be shared between threads."""
        handler = getattr(self._llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        self._llm.shutdown()
        killed = self.guard.close()
        if killed:
            import structlog

            structlog.get_logger("sluice.engine").warning(
                "engine_processes_killed", pids=killed, note="still running after the engine's shutdown")
