"""A restarted engine loads vLLM's AOT compile cache instead of compiling the model again.

vLLM 0.32's CPU build failed every such load; sluice's vLLM plugin (worker/vllm_plugin.py)
mends it. Two engine starts in fresh processes share one empty-at-first cache, as
`bench/cold_start.py` times them; here only what the restart did is checked.
In float32, the dtype the mend was measured in.
"""

import pytest

from bench.cold_start import start

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_restart_loads_the_aot_compile_cache_and_answers_alike(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_DTYPE", "float32")  # the engine processes inherit it
    # The session's shared engine ran `graph-cache`, which turns the AOT cache off in this process's
    # environment (VLLM_USE_AOT_COMPILE=0); the engines started here must not inherit that.
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    first = start("auto", tmp_path / "vllm-cache")
    restart = start("auto", tmp_path / "vllm-cache")
    assert first["recompiled_because"] is None
    assert restart["recompiled_because"] is None, f"compiled again: {restart['recompiled_because']}"
    assert restart["aot_loaded"], "vLLM did not report loading its AOT compile cache"
    assert restart["text"] == first["text"] and restart["text"]
