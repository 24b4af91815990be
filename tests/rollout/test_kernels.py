"""Triton kernels against their torch references (TRITON_INTERPRET=1 on CPU, tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from quarl.rollout.attention import torch_decode_attention, torch_prefill_attention
from quarl.rollout.sampler import sample_reference


def _paged_cache(lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype):
    """Random caches and shuffled block tables covering ``lens`` tokens per sequence."""
    need = [-(-n // page) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, page, hkv, d, dtype=dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, dtype=dtype)
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[at : at + nb].to(torch.int32)
        at += nb
    return k_cache, v_cache, tables


@pytest.mark.parametrize("hq,hkv,d,page", [(4, 2, 16, 4), (6, 2, 12, 8), (4, 1, 32, 16)])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_matches_reference(hq, hkv, d, page, splits):
    from quarl.rollout.kernels import paged_decode_attention

    lens = [1, 70, 13, 130]
    k_cache, v_cache, tables = _paged_cache(lens, page, hkv, d, torch.float32)
    q = torch.randn(len(lens), hq, d)
    ctx = torch.tensor(lens, dtype=torch.int32)
    per_split = -(-max(lens) // splits)
    split_len = torch.tensor([-(-per_split // 64) * 64], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    part_out = torch.empty(len(lens), hq, splits, d) if splits > 1 else None
    part_lse = torch.empty(len(lens), hq, splits) if splits > 1 else None
    paged_decode_attention(q, k_cache, v_cache, tables, ctx, split_len, out, part_out, part_lse, splits, d**-0.5)
    ref = torch_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("hq,hkv,d,page", [(4, 2, 16, 4), (6, 2, 12, 8), (4, 1, 32, 16)])
def test_paged_prefill_and_extend_match_reference(hq, hkv, d, page):
    from quarl.rollout.kernels import paged_prefill_attention

    kv_lens = [5, 90, 17, 1]
    q_lens = [5, 70, 3, 1]  # sequence 1 and 2 extend a cached prefix
    k_cache, v_cache, tables = _paged_cache(kv_lens, page, hkv, d, torch.float32)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), hq, d)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(
        q, k_cache, v_cache, tables, cu, torch.tensor(kv_lens, dtype=torch.int32), max(q_lens), d**-0.5, out=out
    )
    ref = torch_prefill_attention(q, k_cache, v_cache, tables, cu.tolist(), kv_lens, d**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_sampling_kernel_matches_reference():
    from quarl.rollout.kernels import gumbel_sample

    rows, vocab = 6, 300
    logits = torch.randn(rows, vocab) * 3
    inv_temp = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.3, 1.0])
    seeds = torch.randint(0, 2**32, (rows,), dtype=torch.int64)
    noise = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows)
    lse = torch.empty(rows)
    gumbel_sample(logits, inv_temp, seeds, noise, tokens, logprobs, lse)
    ref_tokens, ref_logprobs, ref_lse = sample_reference(logits, inv_temp, seeds, noise)
    assert tokens.tolist() == ref_tokens.tolist()
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-6)


def _fp8_paged_cache(lens: list[int], page: int, hkv: int, d: int):
    """A random fp8 cache: codes and scales of ``quantize_kv`` of rows of varied magnitude
    (a zero row included), and the float32 values attention must read from it."""
    from quarl.quant.kv import dequantize_kv, quantize_kv

    k, v, tables = _paged_cache(lens, page, hkv, d, torch.float32)
    magnitude = torch.logspace(-2, 2, k.shape[0] * page * hkv).view(k.shape[0], page, hkv, 1)
    caches = []
    for x in (k * magnitude, v * magnitude.flip(0)):
        x[0, 0, 0] = 0
        codes, scales = quantize_kv(x)
        caches.append((codes, scales, dequantize_kv(codes, scales, torch.float32)))
    return caches, tables


@pytest.mark.parametrize("hq,hkv,d,page", [(4, 2, 16, 4), (6, 2, 12, 8), (4, 1, 32, 16)])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_reads_fp8_cache(hq, hkv, d, page, splits):
    """The kernel on fp8 codes + scales equals, bit for bit, the kernel on the dequantized
    float32 cache, and the torch reference on the fp8 cache to float tolerance."""
    from quarl.rollout.kernels import paged_decode_attention

    lens = [1, 70, 13, 130]
    ((kc, ks, k_deq), (vc, vs, v_deq)), tables = _fp8_paged_cache(lens, page, hkv, d)
    q = torch.randn(len(lens), hq, d)
    ctx = torch.tensor(lens, dtype=torch.int32)
    per_split = -(-max(lens) // splits)
    split_len = torch.tensor([-(-per_split // 64) * 64], dtype=torch.int32)

    def run(k, v, kv_scales):
        out = torch.full_like(q, float("nan"))
        part_out = torch.empty(len(lens), hq, splits, d) if splits > 1 else None
        part_lse = torch.empty(len(lens), hq, splits) if splits > 1 else None
        return paged_decode_attention(q, k, v, tables, ctx, split_len, out, part_out, part_lse, splits, d**-0.5,
                                      kv_scales=kv_scales)

    got = run(kc, vc, (ks, vs))
    assert torch.equal(got, run(k_deq, v_deq, (None, None)))
    ref = torch_decode_attention(q, kc, vc, tables, lens, d**-0.5, (ks, vs))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(ref, torch_decode_attention(q, k_deq, v_deq, tables, lens, d**-0.5))


@pytest.mark.parametrize("hq,hkv,d,page", [(4, 2, 16, 4), (4, 1, 32, 16)])
def test_paged_prefill_and_extend_read_fp8_cache(hq, hkv, d, page):
    from quarl.rollout.kernels import paged_prefill_attention

    kv_lens = [5, 90, 17, 1]
    q_lens = [5, 70, 3, 1]  # sequence 1 and 2 extend a cached prefix
    ((kc, ks, k_deq), (vc, vs, v_deq)), tables = _fp8_paged_cache(kv_lens, page, hkv, d)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), hq, d)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    got = paged_prefill_attention(q, kc, vc, tables, cu, lens, max(q_lens), d**-0.5, kv_scales=(ks, vs))
    assert torch.equal(got, paged_prefill_attention(q, k_deq, v_deq, tables, cu, lens, max(q_lens), d**-0.5))
    ref = torch_prefill_attention(q, kc, vc, tables, cu.tolist(), kv_lens, d**-0.5, (ks, vs))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(ref, torch_prefill_attention(q, k_deq, v_deq, tables, cu.tolist(), kv_lens, d**-0.5))


def test_cuda_decode_kernel_choice_is_checked_and_falls_back_where_it_cannot_run():
    """``kernel="cuda"`` needs a GPU, head_dim 128 and bf16 queries; elsewhere (here: CPU,
    float32) the Triton kernel runs, with the same result; an unknown kernel name is an error."""
    from quarl.rollout import fp8_decode
    from quarl.rollout.kernels import paged_decode_attention

    lens = [1, 40]
    ((kc, ks, _), (vc, vs, _)), tables = _fp8_paged_cache(lens, 16, 1, 128)
    q = torch.randn(len(lens), 4, 128)
    assert not fp8_decode.supported(q, kc, (ks, vs))
    assert not fp8_decode.supported(q, kc, (None, None))
    args = (q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), torch.tensor([64], dtype=torch.int32))

    def run(kernel):
        return paged_decode_attention(*args, torch.empty_like(q), None, None, 1, 128**-0.5, 32, 4,
                                      kv_scales=(ks, vs), kernel=kernel)

    assert torch.equal(run("cuda"), run("triton"))
    with pytest.raises(ValueError, match="'triton' or 'cuda'"):
        run("cutlass")


def test_cuda_fp8_decode_smem_holds_the_ring_and_the_merge():
    from quarl.rollout.fp8_decode import Fp8DecodeConfig

    # 4 warps x 4 slots of 16 tokens: K and V codes (2 x 16 x 128) and their scales (2 x 16 x 4)
    assert Fp8DecodeConfig(4, 4, 1).smem_bytes() == 4 * 4 * (2 * 16 * 128 + 2 * 16 * 4)
    # 1 warp x 1 slot: the merge scratch (m, l and the padded 16 x 128 accumulator) is larger
    assert Fp8DecodeConfig(1, 1, 1).smem_bytes() == (32 + 16 * 4 * 36) * 4


def test_fp8_cache_needs_a_head_dim_in_whole_words():
    from quarl.rollout.kernels import paged_decode_attention

    kc = torch.zeros(4, 4, 1, 6, dtype=torch.float8_e4m3fn)
    ks = torch.ones(4, 4, 1)
    q = torch.randn(1, 2, 6)
    with pytest.raises(ValueError, match="multiple of 4"):
        paged_decode_attention(q, kc, kc, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                               torch.tensor([64], dtype=torch.int32), torch.empty_like(q), None, None, 1, 1.0,
                               kv_scales=(ks, ks))


def test_decode_splits_keep_the_programs_within_one_wave():
    from quarl.rollout.model_runner import decode_splits

    # H100 (132 SMs), batch 64 x 2 kv heads, 4 programs per SM: 4 splits (512 programs fit in
    # 528 slots), not 5 (640: a second, partial wave)
    assert decode_splits(128, 132, 4, 4096) == 4
    assert decode_splits(256, 132, 8, 4096) == 4
    assert decode_splits(256, 132, 2, 4096) == 1  # more pairs than slots: one split
    assert decode_splits(4, 132, 8, 4096) == 16  # capped
    assert decode_splits(4, 132, 8, 300) == 3  # no split shorter than 128 tokens
