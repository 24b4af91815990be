"""Chunked log-probs equal log_softmax of full logits, values and gradients (float64)."""

from __future__ import annotations

import torch

from quarl.learner.logprobs import sequence_logprobs, token_logprobs
from quarl.model import Transformer, TransformerConfig


def _tiny(vocab: int = 50) -> Transformer:
    cfg = TransformerConfig(
        model_type="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
    )
    torch.manual_seed(1)
    m = Transformer(cfg).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def test_token_logprobs_values_and_grads_match_full_softmax():
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(29, 16, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 29, (37,))
    g = torch.randn(37, dtype=torch.float64)
    for temp in (1.0, 0.7):
        lp, ent = token_logprobs(h, w, tgt, temperature=temp, chunk_size=8, with_entropy=True)
        full = torch.log_softmax((h @ w.t()) / temp, -1)
        ref = full.gather(-1, tgt[:, None]).squeeze(-1)
        torch.testing.assert_close(lp.double(), ref, rtol=1e-6, atol=1e-6)
        ref_ent = -(full.exp() * full).sum(-1)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
        gh, gw = torch.autograd.grad((lp * g).sum(), (h, w))
        rh, rw = torch.autograd.grad((ref * g).sum(), (h, w))
        torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


def test_sequence_logprobs_padded_batch():
    m = _tiny()
    ids = torch.randint(0, 50, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 6:] = 0  # right padding
    lp, _ = sequence_logprobs(m, ids, mask, chunk_size=5)
    with torch.no_grad():
        for i in range(3):
            real = mask[i].bool()
            seq = ids[i][real]
            full = torch.log_softmax(m(seq[None])[0], -1)
            ref = full[:-1].gather(-1, seq[1:, None]).squeeze(-1)
            valid = (mask[i, :-1] & mask[i, 1:]).bool()
            torch.testing.assert_close(lp[i][valid].double(), ref, rtol=1e-9, atol=1e-9)


def test_sequence_logprobs_packed_batch():
    m = _tiny()
    a, b = torch.randint(0, 50, (6,)), torch.randint(0, 50, (4,))
    ids = torch.cat([a, b])[None]
    seq_ids = torch.tensor([[0] * 6 + [1] * 4])
    lp, _ = sequence_logprobs(m, ids, seq_ids=seq_ids)
    with torch.no_grad():
        for s, off in ((a, 0), (b, 6)):
            full = torch.log_softmax(m(s[None])[0], -1)
            ref = full[:-1].gather(-1, s[1:, None]).squeeze(-1)
            torch.testing.assert_close(lp[0, off : off + len(s) - 1].double(), ref, rtol=1e-9, atol=1e-9)


def test_right_padded_batch_takes_the_causal_path_exactly():
    m = _tiny()
    lens = [9, 4, 1, 6]
    ids = torch.randint(0, 50, (4, 9))
    mask = torch.zeros(4, 9, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    from quarl.model.transformer import batch_attention

    _, attn = batch_attention(ids, mask)
    assert attn.__name__ == "causal_attn"  # no explicit mask: SDPA may use its flash kernel
    lp, _ = sequence_logprobs(m, ids, mask)
    with torch.no_grad():
        for i, n in enumerate(lens):
            if n < 2:
                continue
            seq = ids[i, :n]
            full = torch.log_softmax(m(seq[None])[0], -1)
            ref = full[:-1].gather(-1, seq[1:, None]).squeeze(-1)
            torch.testing.assert_close(lp[i, : n - 1].double(), ref, rtol=1e-9, atol=1e-9)
