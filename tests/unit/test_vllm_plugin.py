"""The mends sluice loads into vLLM's processes (worker/vllm_plugin.py)."""

from importlib.metadata import entry_points
from types import SimpleNamespace

import torch

from worker import vllm_plugin


def test_vllm_finds_the_plugin_in_the_installed_metadata():
    """vLLM loads general plugins by entry point: without it no engine process gets the mend."""
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("sluice") == "worker.vllm_plugin:register"


def test_a_plain_compiled_function_gets_a_finalize_and_one_with_its_own_keeps_it(monkeypatch):
    def plain(*args):
        return args

    class Serializable:
        def finalize_loading(self, vllm_config):
            return "own"

    own = Serializable()
    artifacts = iter([SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=plain)),
                      SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=own))])
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f, f_globals=None: next(artifacts))
    vllm_plugin.register()
    mended = torch.compiler.load_compiled_function
    vllm_plugin.register()  # vLLM may load plugins more than once per process: no second wrapper
    assert torch.compiler.load_compiled_function is mended and mended.sluice_mended
    first = torch.compiler.load_compiled_function(None, f_globals={})
    # what vLLM 0.32's AOT loader calls next; without the mend it raised AttributeError
    assert first._artifacts.compiled_fn.finalize_loading(object()) is None
    second = torch.compiler.load_compiled_function(None, f_globals={})
    assert second._artifacts.compiled_fn.finalize_loading(object()) == "own"
