"""Supervised warm-start: teach a fresh built-in model the task's answer format.

RL needs a policy that sometimes earns reward. The built-in demo model starts random,
so it first imitates the task's worked solutions for a few hundred steps (cross
entropy on the assistant tokens only). The result is cached in the run directory
under a key of everything that shaped it, so reruns and ``--resume`` skip it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from pathlib import Path
from typing import Callable

import torch

from quarl.learner.logprobs import sequence_logprobs
from quarl.model.loading import load_model, save_model
from quarl.model.transformer import Transformer


def sft_pairs(task, tokenizer, examples) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) for every example with a worked solution."""
    pairs = []
    for ex in examples:
        if ex.solution is None:
            continue
        prompt = tokenizer.apply_chat_template(task.messages(ex), add_generation_prompt=True)
        pairs.append((prompt, tokenizer.encode(ex.solution) + [tokenizer.eos_token_id]))
    if not pairs:
        raise ValueError("supervised warm-start needs examples with worked solutions; set trainer.sft_warmup_steps=0")
    return pairs


def supervised_finetune(
    model: Transformer,
    pairs: list[tuple[list[int], list[int]]],
    steps: int,
    lr: float,
    batch_size: int = 32,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """AdamW on the targets' negative log-likelihood; returns the loss of each step.

    On CUDA the forward and backward run under bf16 autocast (float32 weights and optimizer
    state, bf16 matrix products): several times the float32 speed on a Hopper GPU."""
    device = model.embed_tokens.weight.device
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / max(steps, 1)))
    losses = []
    model.train()
    for step in range(steps):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        t = max(len(p) + len(r) for p, r in batch)
        ids = torch.zeros(len(batch), t, dtype=torch.long)
        attn = torch.zeros(len(batch), t, dtype=torch.long)
        mask = torch.zeros(len(batch), t - 1)
        for i, (p, r) in enumerate(batch):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            attn[i, : len(p) + len(r)] = 1
            mask[i, len(p) - 1 : len(p) + len(r) - 1] = 1
        ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
        with amp_context(device):
            logp, _ = sequence_logprobs(model, ids, attn)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


def amp_context(device: torch.device):
    """bf16 autocast on CUDA, nothing elsewhere (CPU autocast is slower than float32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cached_warmstart(
    cache_dir: str | Path,
    key: dict,
    build: Callable[[], Transformer],
    train: Callable[[Transformer], list[float]],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Transformer, bool]:
    """The warm-started model from ``cache_dir`` if its key matches, else build, train, save."""
    cache_dir = Path(cache_dir)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    key_file = cache_dir / "warmstart.json"
    if key_file.is_file() and json.loads(key_file.read_text()).get("digest") == digest:
        return load_model(cache_dir, dtype=dtype, device=device), True
    model = build()
    losses = train(model)
    tmp = cache_dir.with_name(cache_dir.name + ".tmp")
    save_model(model, tmp)
    (tmp / "warmstart.json").write_text(json.dumps({"digest": digest, "key": key, "losses": losses}))
    if cache_dir.exists():
        import shutil

        shutil.rmtree(cache_dir)
    tmp.rename(cache_dir)
    return model.to(dtype=dtype), False
