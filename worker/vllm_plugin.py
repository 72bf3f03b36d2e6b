"""Loaded by vLLM in each of its processes (entry point `vllm.general_plugins` in pyproject.toml).

It mends what sluice's engine settings rely on in the pinned vLLM (0.32) and changes nothing else.
vLLM may load it more than once per process, so each mend is idempotent.
"""

from __future__ import annotations


def register() -> None:
    aot_cache_loads_plain_functions()


def _nothing_to_finalize(vllm_config) -> None:
    """A plain compiled function comes out of the cache ready to run."""


def aot_cache_loads_plain_functions() -> None:
    """Let vLLM load an AOT-compiled model whose artifact is a plain function.

    vLLM finalizes every artifact it loads from its AOT compile cache. On the CPU build the
    artifact is Inductor's plain compiled function, which has no `finalize_loading`. The
    AttributeError made every restart compile the model again (bench/RESULTS.md, cold start). A
    function of that kind gets a no-op finalize; an artifact that has its own keeps it.
    """
    import torch

    load = torch.compiler.load_compiled_function
    if getattr(load, "sluice_mended", False):
        return

    def load_compiled_function(*args, **kwargs):
        loaded = load(*args, **kwargs)
        compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            try:
                compiled.finalize_loading = _nothing_to_finalize
            except AttributeError:  # an object without a __dict__: vLLM reports the load failure as before
                pass
        return loaded

    load_compiled_function.sluice_mended = True
    torch.compiler.load_compiled_function = load_compiled_function
