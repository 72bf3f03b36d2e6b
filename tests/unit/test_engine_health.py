"""The engine's health check: vLLM's own (a flag set when its engine core dies) and, when idle, a
round trip to the engine core, so that a frozen or hung engine core fails an idle worker too.

`VllmEngine.check_health` over a stand-in for vLLM's `AsyncLLM`: what it answers and when, and
whether requests are unfinished before and after the round trip. The real engine core frozen
(SIGSTOP) under an idle `sluice worker`: tests/integration/test_worker_process.py.
"""

import asyncio

import pytest

from worker.engine import EngineUnanswered, VllmEngine


class StandInLLM:
    def __init__(self, dead: bool, answers: bool, busy_before: bool, busy_after: bool):
        self.dead, self.answers = dead, answers
        self.busy = [busy_before, busy_after]
        self.asked = 0
        self.output_processor = self

    def has_unfinished_requests(self) -> bool:
        return self.busy[0] if self.asked == 0 else self.busy[1]

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("EngineDeadError: EngineCore encountered an issue")

    async def is_sleeping(self) -> bool:
        self.asked += 1
        if not self.answers:
            await asyncio.sleep(3600)
        return False


def engine_over(llm) -> VllmEngine:
    engine = object.__new__(VllmEngine)  # the check reads `_llm` alone; nothing is loaded
    engine._llm = llm
    return engine


CASES = [
    # (dead, answers, busy before, busy after) -> raises, asked the engine core
    ((False, True, False, False), None, True),  # idle and answering: healthy
    ((False, False, False, False), EngineUnanswered, True),  # idle and frozen: fails
    ((False, False, True, True), None, False),  # busy: not asked (one step may outlast the bound)
    ((False, False, False, True), None, True),  # work came while asking: the stall check judges it
    ((True, True, False, False), RuntimeError, False),  # dead: vLLM's own check raises first
]


@pytest.mark.parametrize("state,raises,asked", CASES)
async def test_check_health(state, raises, asked):
    llm = StandInLLM(*state)
    engine = engine_over(llm)
    if raises is None:
        await asyncio.wait_for(engine.check_health(0.05), 5)
    else:
        with pytest.raises(raises) as caught:
            await asyncio.wait_for(engine.check_health(0.05), 5)
        if raises is EngineUnanswered:
            assert "did not answer a round trip within 0.05 s" in str(caught.value)
    assert (llm.asked == 1) is asked
