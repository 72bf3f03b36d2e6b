"""`sluice model prepare --mla`: a tiny random-weight DeepSeek-V2-style model (MLA attention).

DeepSeek models keep a compressed latent KV per token (multi-head latent attention:
`kv_lora_rank` latent plus a shared rope part) instead of K and V per head. This
builds the smallest model vLLM's CPU MLA backend runs (its decode kernel needs
`kv_lora_rank` 512 and rope dim 64) with the depth of the bundled SmolLM2 (30
layers), so KV pages of the two compare per token. The weights are random from a
fixed seed, so its text means nothing but is reproducible; it borrows SmolLM2's
tokenizer and chat template. Used by the MLA pages test and `bench/mla_pages.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from worker.model import MANIFEST, DEFAULT_DIR as SMOLLM2_DIR, _sha256, is_ready, prepare as prepare_smollm2

DEFAULT_DIR = Path(".sluice/models/tiny-deepseek-v2-mla")
SEED = 20261201
# One place for the shape: the page-size report reads these back from config.json.
SHAPE = dict(
    num_hidden_layers=30, hidden_size=256, intermediate_size=512,
    num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
    first_k_dense_replace=30,  # every layer dense: MLA is the point, not MoE
    max_position_embeddings=2048, initializer_range=0.08, tie_word_embeddings=False,
)


def prepare_mla(out: Path = DEFAULT_DIR, force: bool = False, log=print) -> Path:
    out = Path(out)
    if not force and is_ready(out):
        log(f"model ready at {out} (checksums verified)")
        return out
    tok_dir = prepare_smollm2(SMOLLM2_DIR, log=log)
    log(f"building {out}: random DeepSeek-V2 MLA weights, seed {SEED}")
    import torch
    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    config = DeepseekV2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPE)
    torch.manual_seed(SEED)
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for f in tmp.iterdir():  # readable by the worker image's non-root user when mounted
        f.chmod(0o644)
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"source": f"random DeepSeek-V2 MLA, seed {SEED}", "files": files},
                                           indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"model ready at {out}")
    return out
