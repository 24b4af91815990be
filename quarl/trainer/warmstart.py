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
import os
import random
from pathlib import Path
from typing import Callable

import torch

from quarl.io import replace_dir
from quarl.learner.logprobs import sequence_logprobs
from quarl.model.loading import load_model, save_model
from quarl.model.transformer import Transformer, batch_attention


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


def _collate(batch: list[tuple[list[int], list[int]]], device: torch.device):
    """Right-padded ids, attention mask and the target mask of each next-token position."""
    t = max(len(p) + len(r) for p, r in batch)
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    attn = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t - 1)
    for i, (p, r) in enumerate(batch):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        mask[i, len(p) - 1 : len(p) + len(r) - 1] = 1
    return ids.to(device), attn.to(device), mask.to(device)


def wsd_factor(step: int, steps: int, warmup: int = 10, decay_frac: float = 0.2, floor: float = 0.1) -> float:
    """Warmup-stable-decay: a linear warmup over ``warmup`` steps, the full rate, then a
    linear decay to ``floor`` over the last ``decay_frac`` of the steps (a short run learns
    at the full rate for most of its steps and still ends annealed)."""
    up = min(1.0, (step + 1) / warmup)
    start = steps * (1 - decay_frac)
    if step < start:
        return up
    return up * max(floor, 1 - (1 - floor) * (step - start) / max(steps - start, 1))


@torch.no_grad()
def heldout_metrics(model: Transformer, pairs: list[tuple[list[int], list[int]]], batch_size: int = 64,
                    max_logits: int = 1 << 28) -> dict[str, float]:
    """Teacher-forced scores of held-out worked solutions: ``exact`` is the share whose every
    target token is the model's most likely next token (for a task whose solution is unique
    this is its greedy accuracy, without decoding), ``loss`` the mean target-token NLL.
    At most ``max_logits`` float32 logits exist at once (1 GiB; a 152k vocabulary's rows are
    scored a few at a time)."""
    device = model.embed_tokens.weight.device
    was_training = model.training
    model.eval()
    exact, nll, tokens = 0, 0.0, 0.0
    for i in range(0, len(pairs), batch_size):
        ids, attn, mask = _collate(pairs[i: i + batch_size], device)
        positions, causal = batch_attention(ids, attn, kv_quant=model.kv_quant)
        with amp_context(device):
            hidden = model.hidden_states(ids, positions, causal, max_position=ids.shape[1])[:, :-1]
        rows = max(1, max_logits // (hidden.shape[1] * model.lm_head_weight.shape[0]))
        for r in range(0, hidden.shape[0], rows):
            with amp_context(device):
                logits = torch.nn.functional.linear(hidden[r: r + rows], model.lm_head_weight).float()
            target, m = ids[r: r + rows, 1:], mask[r: r + rows]
            hit = (logits.argmax(-1) == target) | (m == 0)
            exact += int(hit.all(-1).sum())
            logp = logits.gather(-1, target[..., None])[..., 0] - torch.logsumexp(logits, -1)
            nll -= float((logp * m).sum())
            tokens += float(m.sum())
    model.train(was_training)
    return {"exact": exact / max(len(pairs), 1), "loss": nll / max(tokens, 1.0)}


def supervised_finetune(
    model: Transformer,
    pairs: list[tuple[list[int], list[int]]],
    steps: int,
    lr: float,
    batch_size: int = 32,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    heldout: list[tuple[list[int], list[int]]] | None = None,
    eval_every: int = 0,
    on_eval: Callable[[int, dict[str, float]], None] | None = None,
    target_exact: float = 0.0,
) -> list[float]:
    """AdamW on the targets' negative log-likelihood under a warmup-stable-decay schedule
    (:func:`wsd_factor`); returns the loss of each step. With ``heldout`` pairs and
    ``eval_every`` > 0, :func:`heldout_metrics` runs every ``eval_every`` steps and after
    the last, reported to ``on_eval(step, metrics)``.

    ``target_exact`` > 0 (with ``heldout`` and ``eval_every``): the rate stays at its full
    value after the warmup (no decay), and training ends at the first check whose
    ``exact`` share reaches it; ``steps`` is then a cap. A task's accuracy can switch on
    within a few dozen steps at a point no fixed step count predicts, so a base that must
    start RL from partial accuracy stops on the measurement instead.

    On CUDA the forward and backward run under bf16 autocast (float32 weights and optimizer
    state, bf16 matrix products)."""
    device = model.embed_tokens.weight.device
    if target_exact > 0 and not (heldout and eval_every > 0):
        raise ValueError("a warm start that stops at a held-out exact share needs held-out pairs and eval_every > 0")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=device.type == "cuda")
    schedule = {"decay_frac": 0.0} if target_exact > 0 else {}  # (no decay: the stop is not known ahead)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: wsd_factor(s, steps, **schedule))
    losses = []
    model.train()
    with deterministic():
        for step in range(steps):
            batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
            losses.append(_sft_step(model, opt, sched, batch, device))
            if on_step is not None:
                on_step(step, losses[-1])
            if heldout and eval_every > 0 and ((step + 1) % eval_every == 0 or step + 1 == steps):
                metrics = heldout_metrics(model, heldout)
                if on_eval is not None:
                    on_eval(step + 1, metrics)
                if target_exact > 0 and metrics["exact"] >= target_exact:
                    break
    model.eval()
    return losses


def _sft_step(model: Transformer, opt, sched, batch, device: torch.device) -> float:
    """One clipped AdamW step on a batch of (prompt, target) pairs; returns its loss."""
    ids, attn, mask = _collate(batch, device)
    with amp_context(device):
        logp, _ = sequence_logprobs(model, ids, attn)
    loss = -(logp * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.detach())


@contextlib.contextmanager
def deterministic():
    """PyTorch's deterministic algorithms for the block, then the caller's setting again: the
    same warm-start recipe on the same GPU model and software gives the same weights (a
    suite's runs all start from them, and the task's accuracy switches on within a few dozen
    steps, so the order of a kernel's atomic adds would change the base). An operation
    without a deterministic algorithm raises instead of running."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    # torch refuses cuBLAS under deterministic algorithms unless its workspace is fixed
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


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
    extra: Callable[[], dict] | None = None,
) -> tuple[Transformer, bool]:
    """The warm-started model from ``cache_dir`` if its key matches, else build, train, save
    (``warmstart.json`` holds the key, the losses and what ``extra()`` returns after training)."""
    cache_dir = Path(cache_dir)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    key_file = cache_dir / "warmstart.json"
    if key_file.is_file() and json.loads(key_file.read_text()).get("digest") == digest:
        return load_model(cache_dir, dtype=dtype, device=device), True
    model = build()
    losses = train(model)
    tmp = cache_dir.with_name(cache_dir.name + ".tmp")
    save_model(model, tmp)
    record = {"digest": digest, "key": key, "losses": losses, **(extra() if extra is not None else {})}
    (tmp / "warmstart.json").write_text(json.dumps(record))
    replace_dir(tmp, cache_dir)
    return model.to(dtype=dtype), False
