"""Greedy parity with HF transformers on the real default model, SmolLM2-135M-Instruct (fp32)."""

from __future__ import annotations

import pytest
import torch

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model, resolve_model_dir

pytestmark = pytest.mark.slow


def test_smollm2_greedy_and_logits_match_hf() -> None:
    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2-135m", "float32")
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir("smollm2-135m"), dtype=torch.float32).eval()
    engine = LLMEngine(loaded, cache_config=CacheConfig(num_blocks=256))
    tok = loaded.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("The three primary colours are"),
    ]
    # min_tokens masks EOS exactly as HF min_new_tokens does
    sp = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0)
    captured: list[torch.Tensor] = []
    original = engine.runner.model.compute_logits
    engine.runner.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]  # type: ignore[method-assign]
    ours = engine.generate(prompts, sp)  # batched together
    ours_logits = torch.cat(captured)  # [steps * 2, V] interleaved by step
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32, min_new_tokens=32, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )
        expected = out.sequences[0, len(ids):].tolist()
        assert ours[i].token_ids == expected
        hf_logits = torch.stack(out.logits, 1)[0]  # [32, V]
        torch.testing.assert_close(ours_logits[i::2], hf_logits.float(), atol=2e-3, rtol=1e-3)
    assert "Paris" in ours[0].text
