"""quarl's model and engine against HF transformers on the real checkpoint (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

import quarl
from quarl.rollout import Engine, EngineConfig, SamplingParams

QUESTIONS = ("What is 2 plus 3?", "Name the capital of France in one word.")


@pytest.fixture(scope="module")
def both(real_model):
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(real_model))
    hf = tf.AutoModelForCausalLM.from_pretrained(str(real_model), dtype=torch.float32).eval()
    ours = quarl.load_model(real_model, dtype=torch.float32)
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return tok, hf, ours, prompts


def test_checkpoint_is_the_real_model(both):
    _, hf, ours, prompts = both
    c = ours.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert c.tie_word_embeddings and ours.lm_head is None
    # its massive activations, the trigger of issue 81: residual streams in the thousands
    with torch.no_grad():
        h = hf(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
    assert max(float(x.abs().max()) for x in h[:-1]) > 1000


def test_logits_match_transformers(both):
    _, hf, ours, prompts = both
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            got, ref = ours(x), hf(x).logits
        assert got.shape == ref.shape
        rel = float((got - ref).abs().max() / ref.abs().max())
        assert rel < 1e-5, rel
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_decode_matches_transformers(both):
    tok, hf, ours, prompts = both
    engine = Engine(ours, config=EngineConfig(max_model_len=96, num_kv_blocks=16, max_num_seqs=4))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for p, c in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                          pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert c.token_ids == ref, (tok.decode(c.token_ids), tok.decode(ref))
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([p + c.token_ids])).logits[0].double(), -1)
        want = logp[torch.arange(len(p) - 1, len(p) + len(c.token_ids) - 1), torch.tensor(c.token_ids)]
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
    assert "5" in tok.decode(outs[0].token_ids)  # a real instruct model: "2 + 3 = 5"
