"""The long-prompts bench switches where prompts are tokenized, and back, without losing the worker's bound."""

from bench import long_prompts
from worker import prompt_tokens, runner


def test_each_arm_sets_the_bound_and_the_thread_arm_restores_the_workers_own():
    own = prompt_tokens.LONG_TEXT_CHARS
    try:
        for order in (["loop", "thread"], ["thread", "loop", "thread"]):
            for arm in order:
                long_prompts.tokenize_on(arm)
                expected = own if arm == "thread" else 1 << 40
                assert runner.LONG_TEXT_CHARS == prompt_tokens.LONG_TEXT_CHARS == expected
    finally:
        long_prompts.tokenize_on("thread")
    assert runner.LONG_TEXT_CHARS == prompt_tokens.LONG_TEXT_CHARS == own
