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


def _fused_case(n: int, v: int, hdim: int = 24, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hdim, generator=gen) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(v, hdim, generator=gen) * 0.5).bfloat16().requires_grad_(True)
    tgt = torch.randint(0, v, (n,), generator=gen)
    g = torch.randn(n, generator=gen)
    return h, w, tgt, g


def test_fused_logprobs_match_float64_math_on_the_bf16_logits():
    """The Triton path (interpreter on CPU): the 16-bit logits' float64 log-softmax, target
    log-prob and entropy to float32 accuracy, over several vocabulary blocks and a partial chunk."""
    for v, temp in ((5000, 1.0), (29, 0.6)):
        h, w, tgt, _ = _fused_case(37, v)
        lp, ent = token_logprobs(h, w, tgt, temperature=temp, chunk_size=16, with_entropy=True, fused=True)
        assert lp.dtype == ent.dtype == torch.float32
        x = (h @ w.t()).double() / temp  # the GEMM's bf16 output, then float math
        full = torch.log_softmax(x, -1)
        torch.testing.assert_close(lp.double(), full.gather(-1, tgt[:, None]).squeeze(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), -(full.exp() * full).sum(-1), rtol=1e-5, atol=1e-5)


def test_fused_logit_grad_is_the_softmax_gradient_rounded_once():
    from quarl.learner.kernels import logit_grad_, logit_stats

    for v, temp in ((5000, 1.0), (29, 0.6)):
        h, w, tgt, g = _fused_case(37, v, seed=2)
        logits = (h @ w.t()).detach()
        _, lse, _ = logit_stats(logits, tgt, 1 / temp, False)
        x = logits.double() / temp
        d = (torch.nn.functional.one_hot(tgt, v).double() - torch.softmax(x, -1)) * g[:, None].double() / temp
        out = logit_grad_(logits.clone(), tgt, lse, g, 1 / temp)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), d.bfloat16().double(), rtol=2 ** -7, atol=1e-12)


def test_fused_logprob_gradients_chain_through_the_lm_head():
    """The backward is the kernel's gradient times the LM head, chunk by chunk (bf16 GEMMs,
    float32 sum over chunks; one chunk: its bf16 product as it is): equal to those steps done
    by hand, and within bf16 accuracy of the float64 gradient."""
    from quarl.learner.kernels import logit_grad_, logit_stats

    for v, temp, chunk in ((5000, 1.0, 16), (29, 0.6, 16), (5000, 1.0, 64), (29, 0.6, 37)):
        h, w, tgt, g = _fused_case(37, v, seed=1)
        lp, _ = token_logprobs(h, w, tgt, temperature=temp, chunk_size=chunk, fused=True)
        gh, gw = torch.autograd.grad((lp * g).sum(), (h, w))
        assert gh.dtype == gw.dtype == torch.bfloat16
        hand_h, hand_w = [], torch.zeros(v, 24)
        with torch.no_grad():
            for s in range(0, 37, chunk):
                hc, tc = h[s:s + chunk], tgt[s:s + chunk]
                _, lse, _ = logit_stats(hc @ w.t(), tc, 1 / temp, False)
                d = logit_grad_(hc @ w.t(), tc, lse, g[s:s + chunk], 1 / temp)
                hand_h.append(d @ w)
                hand_w += d.t() @ hc
        torch.testing.assert_close(gh, torch.cat(hand_h), rtol=0, atol=0)
        torch.testing.assert_close(gw, hand_w.bfloat16(), rtol=0, atol=0)
        hd, wd = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
        ref = torch.log_softmax((hd @ wd.t()) / temp, -1).gather(-1, tgt[:, None]).squeeze(-1)
        rh, rw = torch.autograd.grad((ref * g.double()).sum(), (hd, wd))
        assert (gh.double() - rh).norm() <= 2e-2 * rh.norm()
        assert (gw.double() - rw).norm() <= 2e-2 * rw.norm()
