"""GPU checks of exact mode (run on the GPU machine; not part of CI): the batch-invariant
kernels compiled for real shapes, and an exact-mode engine against its learner.

Kernels, each against a float64 reference within a bound from its roundings, and a row's
bits alone against the same row inside batches of other rows (first, middle and last
position; a row sliced at an odd element offset, so a less aligned pointer):

* GEMMs on Qwen2.5-1.5B's shapes (q / o 1536x1536 with bias, k / v 256x1536, gate / up
  8960x1536, down 1536x8960, the 151936x1536 LM head), M = 1..4096, dense bf16, and the
  packed w4a16 and w8a8-fp8 kinds on two of them;
* RMSNorm on rows of 896, 3584 and 5120 (and 128: a q / k norm's head), with and without
  the residual add, M = 1..32768;
* the log-softmax over a 151936 vocabulary, per-row temperatures, R = 1..1024;
* attention with head dim 128, GQA groups 7 (28 / 4 heads) and 4 (32 / 8), bf16 and fp8 KV
  caches: a sequence's tokens recomputed alone (the learner's packing of one sequence) equal
  them packed among other sequences at token budgets of 1k, 4k and 16k, in the engine's
  prefill over shuffled pages, in extend steps over cached prefixes, and decoded from the
  cache in batches of 1-256 sequences at several positions.

End to end: an exact-mode engine (CUDA graphs on and off, bf16 and fp8 KV caches; bf16 mode,
and aligned w4a16 on two of those settings) on two small random models (Qwen2-shaped with
attention bias, GQA 7, head dim 64, the 151936 LM head; Qwen3-shaped with q / k norms, GQA 4,
head dim 128; aligned w8a8-fp8 / int8 and LoRA on w4a16 on some settings; a Qwen3-MoE shape with
32 experts, top-4, in bf16, w4a16 and w8a8-fp8) generates with per-request temperatures and a
nucleus cut; the learner
recomputes every sampled token's log-prob bit for bit, at three token budgets and under
autograd. Run: ``PYTHONPATH=. python3 -m pytest
tests_gpu/quant/test_invariant_gpu.py -q -x``.
"""

from __future__ import annotations

import pytest
import torch

from quarl.config.run import QuantConfig
from quarl.learner.batch import build_batch
from quarl.learner.learner import Learner
from quarl.learner.logprobs import sequence_logprobs
from quarl.model.config import TransformerConfig
from quarl.model.lora import DEFAULT_TARGETS, lora_modules
from quarl.model.presets import build_random_model
from quarl.model.transformer import rms_norm
from quarl.quant import quantize_weight
from quarl.quant.kernels.invariant import dense_gemm, invariant_linear
from quarl.quant.kernels.invariant_attention import (
    PagedKV,
    invariant_paged_attention,
    invariant_varlen_attention,
    page_packed_kv,
)
from quarl.quant.kernels.invariant_norm import invariant_rms_norm
from quarl.quant.kernels.invariant_softmax import invariant_token_logprobs
from quarl.quant.kv import dequantize_kv
from quarl.quant.mode import QuantMode
from quarl.quant.scheme import get_scheme
from quarl.rollout import EngineConfig, SamplingParams
from quarl.trainer.weights import LoRASettings, build_engine_and_publisher

DEV = torch.device("cuda")
BF16 = torch.bfloat16
U32 = 2.0**-24
BATCHES = (1, 2, 3, 15, 16, 17, 63, 64, 65, 128, 1000, 4096)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _positions(m: int) -> list[int]:
    return sorted({0, m // 2, m - 1})


def _misaligned(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` copied to a storage offset of one element (a pointer 2 bytes off alignment)."""
    flat = torch.empty(rows.numel() + 1, dtype=rows.dtype, device=rows.device)
    out = flat[1:].view(rows.shape)
    out.copy_(rows)
    return out


def _batch_with(row: torch.Tensor, m: int, pos: int) -> torch.Tensor:
    """``m`` random rows of very different magnitudes with ``row`` at ``pos``."""
    scale = torch.logspace(-2, 2, m, device=DEV)[torch.randperm(m, device=DEV)]
    batch = (torch.randn(m, row.shape[-1], device=DEV) * scale[:, None]).to(row.dtype)
    batch[pos] = row
    return batch


# ------------------------------------------------------------------------------ GEMMs

QWEN15 = [(1536, 1536, True), (256, 1536, True), (8960, 1536, False), (1536, 8960, False), (151936, 1536, False)]


@pytest.mark.parametrize("n,k,bias", QWEN15, ids=[f"{n}x{k}" for n, k, _ in QWEN15])
def test_dense_gemm_row_bits_at_every_batch_size(n, k, bias):
    w = (torch.randn(n, k, device=DEV) * 0.02).to(BF16)
    b = (torch.randn(n, device=DEV) * 0.1).to(BF16) if bias else None
    x = torch.randn(1, k, device=DEV).to(BF16)
    alone = dense_gemm(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    bound = 2.0**-8 * ref.abs() + 2 * k * U32 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert bool(((alone.double() - ref).abs() <= bound).all())
    assert _same(dense_gemm(_misaligned(x), w, b), alone)
    for m in BATCHES if n * k < 10**8 else (1, 7, 64, 1000, 4096):
        for pos in _positions(m):
            batch = _batch_with(x[0], m, pos)
            assert _same(dense_gemm(batch, w, b)[pos : pos + 1], alone), (m, pos)
        assert _same(dense_gemm(_misaligned(batch), w, b)[pos : pos + 1], alone), (m, "misaligned")


@pytest.mark.parametrize("scheme,tol", [("w4a16", 1e-2), ("w8a8-fp8", 0.1)])  # fp8: the activations' e4m3 codes
@pytest.mark.parametrize("n,k", [(1536, 1536), (1536, 8960)])
def test_packed_gemm_row_bits_at_every_batch_size(scheme, tol, n, k):
    qw = quantize_weight((torch.randn(n, k, device=DEV) * 0.02).to(BF16), scheme)
    x = torch.randn(1, k, device=DEV).to(BF16)
    alone = invariant_linear(x, qw)
    ref = x.double() @ qw.dequantize(torch.float64).T
    assert float((alone.double() - ref).norm() / ref.norm()) < tol
    for m in (2, 17, 64, 65, 1000, 4096):
        for pos in _positions(m):
            assert _same(invariant_linear(_batch_with(x[0], m, pos), qw)[pos : pos + 1], alone), (m, pos)


@pytest.mark.parametrize("scheme", ["bf16", "w4a16", "w4a16-asym", "w2a16", "w8a8-fp8", "w8a8-int8"])
@pytest.mark.parametrize("n,k", [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)])
def test_every_tile_of_the_table_gives_the_same_bits(scheme, n, k):
    """invariant_config picks the tile by M among one K walk (invariant.py's module doc): every
    tile it may return computes every row to the same bits, with K's segments summed in one
    program or in one program each, and a packed weight-only weight dequantized then run
    through the dense kernel (the learner's route at large M) too."""
    from quarl.quant.kernels import invariant as inv
    from quarl.quant.kernels.act_quant import act_quant
    from quarl.quant.kernels.weight_only import dequantize

    w = (torch.randn(n, k, device=DEV) * 0.02).to(BF16)
    x = torch.randn(300, k, device=DEV).to(BF16)
    if scheme == "bf16":
        kind, run = "dense", lambda cfg, par=None: inv.dense_gemm(x, w, None, cfg, parallel=par)
    elif scheme.startswith("w8a8"):
        qw = quantize_weight(w, scheme)
        xq, sx = act_quant(x, get_scheme(scheme).act_format)
        kind, run = "w8a8", lambda cfg, par=None: inv.w8a8_gemm(xq, sx, qw, None, BF16, cfg, parallel=par)
    else:
        qw = quantize_weight(w, scheme)
        kind, run = "weight_only", lambda cfg, par=None: inv.weight_only_gemm(x, qw, None, cfg, parallel=par)
    tiles = inv.same_bits_tiles(kind)
    assert len(tiles) >= 3
    first = run(tiles[0])
    for cfg in tiles[1:]:
        assert _same(run(cfg), first), cfg
    if inv.k_segment(k) < k:  # K in segments: one program each, or all in one
        for cfg in tiles:
            assert _same(run(cfg, True), first), ("a program per K segment", cfg)
    if kind == "weight_only":
        wd = dequantize(qw, BF16)
        for cfg in inv.same_bits_tiles("dense"):
            assert _same(inv.dense_gemm(x, wd, None, cfg), first), ("dense route", cfg)


# ---------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("n", [128, 896, 3584, 5120])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_row_bits_and_accuracy(n, residual):
    w = (1 + 0.1 * torch.randn(n, device=DEV)).to(BF16)
    x = (torch.randn(1, n, device=DEV) * 3).to(BF16)
    r = (torch.randn(1, n, device=DEV) * 30).to(BF16) if residual else None
    alone = invariant_rms_norm(x, w, 1e-6, r)
    y = alone[0] if residual else alone
    s = (r + x) if residual else x  # (the residual add: one bf16 rounding, as the kernel's)
    ref = rms_norm(s.double(), w.double(), 1e-6)
    assert bool(((y.double() - ref).abs() <= 2.0**-7 * ref.abs() + 1e-6).all())
    if residual:
        assert _same(alone[1], r + x)
    for m in (2, 7, 64, 1000, 4096, 32768):
        for pos in _positions(m):
            got = invariant_rms_norm(_batch_with(x[0], m, pos), w, 1e-6,
                                     _batch_with(r[0], m, pos) if residual else None)
            if residual:
                assert _same(got[0][pos : pos + 1], alone[0]) and _same(got[1][pos : pos + 1], alone[1]), (m, pos)
            else:
                assert _same(got[pos : pos + 1], alone), (m, pos)


# ------------------------------------------------------------------------ log-softmax

def test_logsoftmax_151936_row_bits_per_row_temperature_and_accuracy():
    v = 151936
    row = (torch.randn(1, v, device=DEV) * 4).to(BF16)
    tgt = torch.tensor([1234], device=DEV)
    alone = invariant_token_logprobs(row, tgt, 1 / 0.7, with_entropy=True)
    x = row.double() / 0.7
    lse = torch.logsumexp(x, -1)
    assert abs(float(alone[1][0]) - float(lse[0])) <= (v + 16) * U32 + 2 * U32 * abs(float(lse[0]))
    assert abs(float(alone[0][0]) - float(x[0, 1234] - lse[0])) <= (v + 16) * U32 + 4 * U32 * abs(float(lse[0]))
    for r in (2, 33, 256, 1024):
        for pos in _positions(r):
            batch = _batch_with(row[0], r, pos)
            targets = torch.randint(0, v, (r,), device=DEV)
            targets[pos] = tgt[0]
            inv_t = torch.rand(r, device=DEV) + 0.5
            inv_t[pos] = 1 / 0.7
            got = invariant_token_logprobs(batch, targets, inv_t, with_entropy=True)
            for a, b in zip(got, alone):
                assert _same(a[pos : pos + 1], b), (r, pos)


# -------------------------------------------------------------------------- attention

D, PAGE = 128, 16
GROUPS = [(28, 4), (32, 8)]  # GQA 7 (Qwen2.5-7B), 4 (Qwen3-8B)


def _seq(n: int, hq: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(n, hq, D, device=DEV).to(BF16), (torch.randn(n, hkv, D, device=DEV) * 2).to(BF16),
            torch.randn(n, hkv, D, device=DEV).to(BF16))


def _shuffled(kv: PagedKV) -> PagedKV:
    """The same cache with its pages in a random order (as an engine hands them out)."""
    perm = torch.randperm(kv.k.shape[0], device=DEV)
    moved = [None if t is None else torch.empty_like(t).index_copy_(0, perm, t) if t.dtype != torch.float8_e4m3fn
             else torch.empty_like(t.view(torch.uint8)).index_copy_(0, perm, t.view(torch.uint8)).view(t.dtype)
             for t in (kv.k, kv.v, kv.k_scale, kv.v_scale)]
    return PagedKV(*moved, perm[kv.block_tables.long()].int(), kv.kv_lens)


def _paged(seqs, lens, fp8: bool) -> PagedKV:
    """The first ``lens[i]`` tokens of each (q, k, v) of ``seqs`` in a shuffled paged cache."""
    k = torch.cat([s[1][:n] for s, n in zip(seqs, lens)])
    v = torch.cat([s[2][:n] for s, n in zip(seqs, lens)])
    return _shuffled(page_packed_kv(k, v, list(lens), PAGE, fp8))


def _run(q: torch.Tensor, kv: PagedKV, q_lens: list[int]) -> torch.Tensor:
    cu = torch.tensor([0] + q_lens, device=DEV).cumsum(0).int()
    return invariant_paged_attention(q, kv.k, kv.v, kv.block_tables, cu, kv.kv_lens, max(q_lens), D**-0.5,
                                     (kv.k_scale, kv.v_scale))


def _reference(seq, fp8: bool) -> torch.Tensor:
    """Causal GQA attention in float64 on K / V as the cache holds them."""
    from quarl.quant.kv import quantize_kv

    q, k, v = seq
    if fp8:
        k, v = (dequantize_kv(*quantize_kv(t), torch.float64) for t in (k, v))
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * D**-0.5
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=DEV).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("hq,hkv", GROUPS, ids=["gqa7", "gqa4"])
def test_attention_learner_packing_prefill_extend_and_decode_bits(hq, hkv, fp8):
    gen = torch.Generator().manual_seed(1)
    lens = [1, 17, 64, 65, 300, 1000]
    seqs = [_seq(n, hq, hkv) for n in lens]
    for s, n in zip(seqs, lens):
        alone = invariant_varlen_attention(*s, [n], D**-0.5, PAGE, fp8)
        ref = _reference(s, fp8)
        assert float((alone.double() - ref).norm() / ref.norm()) < 1e-2
        _check_packing(alone, s, n, hq, hkv, fp8, gen)
        _check_prefill_and_extend(alone, s, n, hq, hkv, fp8)
        _check_decode(alone, s, n, hq, hkv, fp8, gen)


def _check_packing(alone, s, n, hq, hkv, fp8, gen) -> None:
    """The learner's micro-batches: the sequence among others filling a token budget."""
    for budget in (1024, 4096, 16384):
        before = _fill(max(0, budget - n) // 2, gen)
        after = _fill(max(0, budget - n - sum(before)), gen)
        others = [_seq(m, hq, hkv) for m in before + after]
        order = others[: len(before)] + [s] + others[len(before) :]
        lengths = before + [n] + after
        out = invariant_varlen_attention(*(torch.cat([o[i] for o in order]) for i in range(3)), lengths, D**-0.5,
                                         PAGE, fp8)
        start = sum(before)
        assert _same(out[start : start + n], alone), ("budget", budget, n)


def _fill(tokens: int, gen) -> list[int]:
    out = []
    while tokens > 0:
        m = min(tokens, int(torch.randint(1, 1200, (1,), generator=gen)))
        out.append(m)
        tokens -= m
    return out


def _check_prefill_and_extend(alone, s, n, hq, hkv, fp8) -> None:
    """The engine's prefill of the sequence among two others over shuffled pages, then extend
    steps (new tokens over a cached prefix)."""
    a, b = _seq(33, hq, hkv), _seq(500, hq, hkv)
    kv = _paged([a, s, b], [33, n, 500], fp8)
    out = _run(torch.cat([a[0], s[0], b[0]]), kv, [33, n, 500])
    assert _same(out[33 : 33 + n], alone), ("prefill", n)
    for cached in sorted({0, n // 3, n - 1}):
        kv = _paged([s], [n], fp8)
        assert _same(_run(s[0][cached:], kv, [n - cached]), alone[cached:]), ("extend", n, cached)


def _check_decode(alone, s, n, hq, hkv, fp8, gen) -> None:
    """One new token per sequence (the engine's decode step) at several positions, in batches
    of 1-256 sequences of other lengths, the sequence's row at its first, middle or last place."""
    for p in sorted({0, 15, 16, 63, 64, 511, 512, n - 1} & set(range(n))):  # (512 keys a split)
        for bsz in (1, 7, 64, 256):
            lens = [int(x) for x in torch.randint(1, 700, (bsz,), generator=gen)]
            row = [0, bsz // 2, bsz - 1][p % 3]
            lens[row] = p + 1
            # the other sequences: K / V of their contexts and the q of their new token only
            seqs = [(None, *_seq(m, 1, hkv)[1:]) if i != row else s for i, m in enumerate(lens)]
            kv = _paged(seqs, lens, fp8)
            q = torch.randn(bsz, hq, D, device=DEV).to(BF16)
            q[row] = s[0][p]
            out = _run(q, kv, [1] * bsz)
            assert _same(out[row : row + 1], alone[p : p + 1]), ("decode", n, p, bsz)


# -------------------------------------------------------------------------- end to end

QWEN2 = TransformerConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                          num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                          attention_bias=True, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                          max_position_embeddings=4096)
QWEN3 = TransformerConfig(model_type="qwen3", vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                          qk_norm=True, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                          max_position_embeddings=4096)
TEMPS = (1.0, 0.7, 1.3)


QWEN3_MOE = TransformerConfig(model_type="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                              num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                              qk_norm=True, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                              max_position_embeddings=4096, num_experts=32, num_experts_per_tok=4,
                              moe_intermediate_size=512, norm_topk_prob=True)


def _exact_engine(cfg: TransformerConfig, kv: str, graphs: bool, scheme: str = "bf16", dense: str = "auto"):
    """``scheme``: bf16 mode, an aligned scheme, or ``lora-<scheme>`` (rank-8 adapters on that frozen
    base, B made non-zero and published); ``dense``: the engine's ``dense_weights`` (auto: these
    small models keep dense copies, which exact mode runs through the dense kernel)."""
    model = build_random_model(cfg, dtype=BF16, device=DEV, std=0.05)
    lora = LoRASettings(8, 16.0, DEFAULT_TARGETS if not cfg.is_moe else ("q_proj", "k_proj", "v_proj", "o_proj")) \
        if scheme.startswith("lora-") else None
    scheme = scheme.removeprefix("lora-")
    mode = QuantMode.BF16 if scheme == "bf16" else QuantMode.ALIGNED
    quant = QuantConfig(mode=mode, scheme=get_scheme(scheme), exact=True)
    quant.validate()
    config = EngineConfig(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=4096, num_kv_blocks=2048,
                          gpu_memory_utilization=0.5, cuda_graphs=graphs, kv_cache_dtype=kv,
                          dense_weights=dense)
    engine, publisher = build_engine_and_publisher(model, quant, config, lora, record_routes=cfg.is_moe)
    if lora is not None:
        with torch.no_grad():
            for _, _, ad in lora_modules(model):
                ad.B.normal_(0, 0.05)
        publisher.publish()
    return model, engine


def _prompts(vocab: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (int(torch.randint(5, 200, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


def _params(i: int, n: int = 2) -> SamplingParams:
    return SamplingParams(n=n, temperature=TEMPS[i % 3], top_p=0.9 if i % 4 == 0 else 1.0, max_new_tokens=48,
                          ignore_eos=True, seed=17)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("cfg", [QWEN2, QWEN3], ids=["qwen2-gqa7", "qwen3-gqa4"])
def test_exact_engine_and_learner_agree_bit_for_bit(cfg, kv, graphs):
    _check_engine_and_learner(cfg, kv, graphs, "bf16")


@pytest.mark.parametrize("cfg,kv,graphs,dense", [(QWEN3, "auto", True, "auto"), (QWEN2, "fp8", False, "auto"),
                                                 (QWEN3, "fp8", True, "off")],
                         ids=["qwen3-gqa4-auto-graphs", "qwen2-gqa7-fp8-eager", "qwen3-fp8-graphs-packed"])
def test_exact_aligned_w4a16_engine_and_learner_agree_bit_for_bit(cfg, kv, graphs, dense):
    """Aligned w4a16: the engine's QuantLinear and the learner's QATLinear on the same codes; the
    engine on its dense copies (dense kernel) or on the packed codes (packed kernel)."""
    _check_engine_and_learner(cfg, kv, graphs, "w4a16", dense)


@pytest.mark.parametrize("cfg,kv,graphs,scheme", [
    (QWEN3, "fp8", True, "w8a8-fp8"), (QWEN2, "auto", False, "w8a8-int8"), (QWEN3, "fp8", True, "lora-w4a16"),
    (QWEN3_MOE, "auto", True, "bf16"), (QWEN3_MOE, "fp8", True, "w4a16"), (QWEN3_MOE, "auto", False, "w8a8-fp8"),
], ids=["qwen3-w8a8-fp8-kvfp8", "qwen2-w8a8-int8-eager", "qwen3-lora-w4a16-kvfp8", "moe-bf16", "moe-w4a16-kvfp8",
        "moe-w8a8-fp8-eager"])
def test_exact_w8a8_lora_and_moe_engine_and_learner_agree_bit_for_bit(cfg, kv, graphs, scheme):
    """Aligned W8A8 (per-token codes, the code GEMM), LoRA on a w4a16 base, and an MoE model
    (router, grouped experts at one tile, the slot sum) in bf16, w4a16 and w8a8-fp8."""
    _check_engine_and_learner(cfg, kv, graphs, scheme)


def _check_engine_and_learner(cfg: TransformerConfig, kv: str, graphs: bool, scheme: str, dense: str = "auto") -> None:
    model, engine = _exact_engine(cfg, kv, graphs, scheme, dense)
    assert engine.runner.exact is not None and not engine.runner.fused
    if scheme in ("w4a16", "lora-w4a16") and not cfg.is_moe:
        assert (engine.runner.dense_weight_bytes > 0) == (dense == "auto")
    if not cfg.is_moe and not scheme.startswith("lora-"):
        learner_linear, served = model.layers[0].mlp.down_proj, engine.model.layers[0].mlp.down_proj
        assert type(served).__name__ == ("Linear" if scheme == "bf16" else "QuantLinear")
        if scheme != "bf16":
            assert type(learner_linear).__name__ == "QATLinear"
    prompts = _prompts(cfg.vocab_size, 24)
    alone = engine.generate([prompts[0]], _params(0, n=1))[0]
    comps = engine.generate(prompts, [_params(i) for i in range(len(prompts))])
    same = [c for c in comps if c.prompt_index == 0 and c.sample_index == 0][0]
    assert same.token_ids == alone.token_ids and _same(torch.tensor(same.logprobs), torch.tensor(alone.logprobs))
    learner = Learner(model)
    for t in TEMPS:
        group = [c for c in comps if TEMPS[c.prompt_index % 3] == t]
        batch = build_batch([prompts[c.prompt_index] for c in group], [c.token_ids for c in group],
                            [c.logprobs for c in group], [0.0] * len(group), torch.zeros(len(group))).to(DEV)
        mask = batch.response_mask.bool()
        for budget in (1024, 4096, 16384):
            logp = learner.logprobs(batch, budget, temperature=t)
            assert _same(logp[mask], batch.sampler_logp[mask]), (t, budget)
        logp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature=t, right_padded=True,
                                    with_entropy=True)
        assert logp.requires_grad and _same(logp.detach()[mask], batch.sampler_logp[mask]), (t, "autograd")
        (logp * batch.response_mask).sum().backward()
        trained = [p for p in model.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in trained)
        model.zero_grad()
    _check_near_the_ordinary_forward(model, batch, t)


def _check_near_the_ordinary_forward(model, batch, t: float) -> None:
    """Exact mode rounds otherwise than the ordinary kernels, by bf16 noise only: small on
    average; a few tokens move further on these random models (a W8A8 code step or an MoE
    router's top-k flipped by a last-bit difference: up to ~1 nat seen on an H100)."""
    exact, model.exact = model.exact, None
    try:
        with torch.no_grad():
            ordinary = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature=t,
                                         right_padded=True)[0]
    finally:
        model.exact = exact
    mask = batch.response_mask.bool()
    diff = (ordinary[mask] - batch.sampler_logp[mask]).abs()
    assert float(diff.mean()) < 0.15 and float(diff.max()) < 2.0, (float(diff.mean()), float(diff.max()))
