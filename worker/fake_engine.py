"""A deterministic stand-in engine for fast tests of scheduling, offsets and overhead.

Never the only proof a feature works: integration tests run the real vLLM engine.
Each token follows from the one before it (`(last * 37 + 11) % 1000`, the first from the prompt's
last id), its text `"<t{id}>"`: like greedy decoding, continuing from prompt + generated tokens
gives exactly what an uninterrupted run would, so suspensions and failovers can be checked.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque

from schemas import Request
from worker.engine import Delta, GenParams


_TOKEN = re.compile(r"<t(\d+)>|(.)", re.S)
IDS_KEPT = 10_000  # request ids remembered for tests; a long-running fake worker must not grow without end


class FakeEngine:
    tokenizer_id = "fake"

    def __init__(self, max_model_len: int = 2048, token_delay_s: float = 0.0, tokens_per_delta: int = 1):
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.tokens_per_delta = tokens_per_delta
        self.started: deque[str] = deque(maxlen=IDS_KEPT)
        self.aborted: deque[str] = deque(maxlen=IDS_KEPT)

    def prompt_ids(self, request: Request) -> list[int]:
        text = request.prompt if request.prompt is not None else " ".join(m.content for m in request.messages or ())
        return [b % 256 for b in text.encode()] or [0]

    def render_ids(self, text: str, chat: bool, system: str | None) -> list[int]:
        return [b % 256 for b in ((system or "") + text).encode()] or [0]

    def label_ids(self, labels: list[str], chat: bool) -> list[list[int]]:
        return [[1000 + (b % 256) for b in label.encode()] for label in labels]

    def text_ids(self, text: str) -> list[int]:
        """Its own token texts back to their ids; any other character is a byte id, as prompts are."""
        return [int(tok) if tok else ord(ch) % 256 for tok, ch in _TOKEN.findall(text)]

    async def generate(self, request_id: str, prompt_ids: list[int], params: GenParams, priority: int):
        self.started.append(request_id)
        base = sum(prompt_ids)
        last = prompt_ids[-1] if prompt_ids else 0
        i = 0
        while i < params.max_tokens:
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            n = min(self.tokens_per_delta, params.max_tokens - i)
            ids = []
            for _ in range(n):
                last = (last * 37 + 11) % 1000
                ids.append(last)
            i += n
            # Label logprobs: a fixed function of the prompt, so tests can compute them too.
            logprobs = ({t: -1.0 - ((base + t) % 7) for t in params.logprob_token_ids}
                        if params.logprob_token_ids and i == n else None)
            yield Delta("".join(f"<t{t}>" for t in ids), ids, "length" if i >= params.max_tokens else None, logprobs)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def check_health(self, timeout_s: float) -> None:
        return None

    def cpu_times(self) -> dict[int, float] | None:
        return None  # it runs on the worker's own loop: a frozen loop is the monitor's own lag

    def shutdown(self) -> None:
        return None

    async def close(self) -> None:
        return None
