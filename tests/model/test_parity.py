"""quarl's transformer against HF transformers on tiny random checkpoints (float32)."""

from __future__ import annotations

import torch

import quarl


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_logits_match_hf(hf_checkpoint):
    family, path, hf = hf_checkpoint
    model = quarl.load_model(path, dtype=torch.float32)
    for length in (1, 7, 40, 130):  # 130 > llama's original rope context of 16
        ids = torch.randint(0, hf.config.vocab_size, (2, length))
        with torch.no_grad():
            ours, ref = model(ids), hf(ids).logits
        assert ours.shape == ref.shape
        assert _rel(ours, ref) < 1e-5, (family, length)


def test_padded_batch_matches_single_sequences(hf_checkpoint):
    family, path, hf = hf_checkpoint
    model = quarl.load_model(path)
    lens = [5, 11, 3]
    seqs = [torch.randint(3, hf.config.vocab_size, (n,)) for n in lens]
    ids = torch.zeros(3, 11, dtype=torch.long)
    mask = torch.zeros(3, 11, dtype=torch.long)
    for i, s in enumerate(seqs):  # row 0 right-padded, row 2 left-padded
        if i == 2:
            ids[i, -len(s) :], mask[i, -len(s) :] = s, 1
        else:
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        for i, s in enumerate(seqs):
            ref = hf(s[None]).logits[0]
            got = batched[i][mask[i].bool()]
            assert _rel(got, ref) < 1e-5, (family, i)
