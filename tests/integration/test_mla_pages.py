"""KV pages of a DeepSeek-style model (multi-head latent attention) survive a SIGKILL.

A tiny random-weight DeepSeek-V2 model (`sluice model prepare --mla`) runs on vLLM's
CPU MLA backend, whose KV cache holds one compressed latent per token and layer
(kv_lora_rank 512 + rope 64) instead of K and V per head. Its pages go to Redis
and come back on the survivor of a SIGKILL; each text equals an uninterrupted run
of the same prompt (with every stored page removed first, and MLA on CPU runs
without a local prefix cache); each stored page holds exactly
the latent bytes of its tokens.
"""

import json
import uuid

import pytest

from tests.integration.helpers import delete_pages, metric
from tests.integration.kill_resume import assert_one_stream_each, kill_mid_stream, spread_ids
from worker.model_mla import prepare_mla

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N, MAX_TOKENS, BLOCK = 4, 96, 16  # vLLM's CPU MLA backend forces 16-token blocks


def prompt(k: int) -> str:
    return f"Ledger {k}: " + " ".join(f"entry {k * 50 + i} settled at {(k * 7 + i) % 97} units;" for i in range(20))


async def test_mla_pages_resume_a_killed_stream_unchanged(settings, catalog, tmp_path):
    model_dir = prepare_mla()
    config = json.loads((model_dir / "config.json").read_text())
    tag = uuid.uuid4().hex[:6]
    ids = spread_ids(f"mla-{tag}", N, catalog.request_topic("standard").partitions)
    prompts = {rid: prompt(k) for k, rid in enumerate(ids)}

    async def uninterrupted(send, collect):
        # every page of the first runs removed: the reference recomputes (MLA on CPU keeps no local prefix cache)
        assert delete_pages(settings) > 0
        refs = {f"ref-{rid}": {"prompt": p, "max_tokens": MAX_TOKENS} for rid, p in prompts.items()}
        await send(refs)
        return {rid.removeprefix("ref-"): done[0].text for rid, done in (await collect(list(refs))).items()}

    # float32: random weights give flat logits, and bf16 rounding (prefill and decode attend through
    # different MLA kernels) would flip near-ties between any two runs, killed or not
    run = await kill_mid_stream(settings, catalog, tmp_path, model_dir, prompts, MAX_TOKENS, after=uninterrupted,
                                extra_env={"SLUICE_DTYPE": "float32"}, one_compiles=True)
    assert "Using CPU_MLA backend" in run.survivor_log, "the engine did not run MLA attention"
    assert not run.orphaned_engine_procs
    assert_one_stream_each(run, prompts)
    resumed = [rid for rid in prompts if run.finals[rid][0].resumed]
    assert resumed, "no request was on the killed worker"
    m = run.survivor_metrics
    assert metric(m, "sluice_prefill_tokens_total", source="redis") > 0, m[-2000:]
    for rid in prompts:
        assert run.finals[rid][0].text == run.after[rid], (rid, run.finals[rid][0].resumed)
    # a page is BLOCK tokens of every layer's latent: nothing else but its small header
    itemsize = 4 if "dtype=torch.float32" in run.survivor_log else 2
    latent = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * itemsize
    stored_pages = metric(m, "sluice_kv_pages_total", op="stored")
    per_token = metric(m, "sluice_kv_bytes_total", op="stored") / stored_pages / BLOCK
    assert stored_pages > 0 and latent <= per_token <= latent * 1.01, (per_token, latent)
