"""Rollout throughput benchmark on random weights, against its floor and HF ``generate``.

Method (docs/performance.md): the memory bandwidth (device-to-device copy, read + write) and
the bf16 matrix rate (8192^3 product) are measured first. A decode step of a batch
whose sequences hold ``c_i`` tokens must read every weight the step uses once (all
decoder linears at their stored size, norms, the LM head; the embedding lookup is
``B`` rows) and the K/V of ``sum_i c_i`` tokens, and must do ``2 * params * B`` FLOPs:
its floor is ``max(bytes / bandwidth, flops / rate)``. Summed over the ``G - 1`` decode
steps of a forced-length run, that floor divided by the measured decode time is the
fraction achieved. Prefill floor: FLOPs / rate. Throughput counts generated tokens
over the whole ``generate`` call (prefill included).
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from quarl.bench.common import (check_baseline, child_env, child_failed, git_commit, idle_gaps, package_root,
                                write_json)
from quarl.bench.timing import Ceilings, measure_ceilings, median_cuda_time
from quarl.model.config import TransformerConfig
from quarl.model.presets import DEMO_PRESETS, PRESETS
from quarl.model.transformer import Rotary, Transformer
from quarl.rollout.config import EngineConfig
from quarl.rollout.engine import Engine
from quarl.rollout.kv_cache import KVCache
from quarl.rollout.sampling_params import SamplingParams

# the released shapes of quarl.model.presets, with their tokenizers' EOS id
SHAPES: dict[str, dict[str, Any]] = {
    name: dict(PRESETS[name], eos_token_id=151645 if PRESETS[name]["model_type"] in ("qwen3", "qwen3_moe") else 151643)
    for name in PRESETS if name not in DEMO_PRESETS
}
# shapes whose bf16 weights would leave a GPU little for the KV cache (a 32B model's are 65 GB):
# a low-bit format packs their random weights one linear at a time, never holding them in bf16
PACKED_ON_LOAD = ("qwen2.5-14b", "qwen2.5-32b", "qwen3-30b-a3b")


def shape_config(shape: str, max_len: int) -> TransformerConfig:
    return TransformerConfig(**dict(SHAPES[shape], max_position_embeddings=max(max_len, 4096)))


def bench_model(shape: str, fmt: str, device: torch.device, max_len: int, seed: int = 0) -> Transformer:
    """The random model a benchmark runs: :func:`random_model`, or for a low-bit format of a
    ``PACKED_ON_LOAD`` shape the same distribution packed as it is made
    (:func:`~quarl.model.quantized_loading.random_quantized_model`)."""
    cfg = shape_config(shape, max_len)
    if fmt != "bf16" and shape in PACKED_ON_LOAD:
        from quarl.model.quantized_loading import random_quantized_model

        return random_quantized_model(cfg, fmt, seed=seed, device=device)
    return random_model(cfg, device, seed)


@torch.no_grad()
def random_model(cfg: TransformerConfig, device: torch.device, seed: int = 0) -> Transformer:
    """bf16 model with N(0, 0.02) weights and biases, unit norms (finite, non-degenerate logits)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    model.rotary = Rotary(cfg).to(device)
    return model.eval()


def step_weight_bytes(model: Transformer, batch: int = 1) -> int:
    """Bytes a decode step of ``batch`` sequences reads of the weights (embedding table excluded
    unless tied). An MoE layer's experts count with the share of them the step's tokens reach:
    ``1 - (1 - k / E) ** batch`` of ``E`` experts when each token picks ``k`` of them evenly (a
    router on random weights; a trained one, less even, reaches fewer)."""
    cfg = model.config
    touched = 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** batch if cfg.is_moe else 1.0
    total = 0.0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rotary") or (name == "embed_tokens.weight" and model.lm_head is not None):
            continue
        total += t.numel() * t.element_size() * (touched if ".mlp.experts." in name else 1.0)
    return int(total)


def floors(cfg: TransformerConfig, weight_bytes: int, batch: int, prompt_len: int, gen_len: int,
           ceil: Ceilings, kv_cache_dtype: str = "auto") -> dict[str, float]:
    # K and V of one token across layers (a one-token block): bf16 rows, or fp8 codes plus scales
    kv_per_token = KVCache.bytes_per_block(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim,
                                           torch.bfloat16, kv_cache_dtype)
    flops_per_token = 2 * cfg.matmul_params
    decode = []
    for k in range(1, gen_len):  # decode step k runs token prompt_len + k - 1, context prompt_len + k
        mem = (weight_bytes + batch * (prompt_len + k) * kv_per_token) / ceil.bandwidth
        attn_flops = 4 * batch * (prompt_len + k) * cfg.q_size * cfg.num_hidden_layers
        decode.append(max(mem, (batch * flops_per_token + attn_flops) / ceil.bf16_flops))
    prefill_flops = (batch * prompt_len * flops_per_token
                     + 2 * batch * prompt_len**2 * cfg.q_size * cfg.num_hidden_layers)
    return {
        "decode_floor_s": sum(decode),
        "decode_step_floor_ms_mean": 1e3 * sum(decode) / max(len(decode), 1),
        "decode_step_floor_ms_first": 1e3 * decode[0] if decode else 0.0,
        "decode_step_floor_ms_last": 1e3 * decode[-1] if decode else 0.0,
        "weights_read_ms": 1e3 * weight_bytes / ceil.bandwidth,
        "prefill_floor_s": prefill_flops / ceil.bf16_flops,
    }


def split_exact(fmt: str) -> tuple[str, bool]:
    """``"w4a16+exact"`` -> ``("w4a16", True)``: a format with ``+exact`` runs the engine in
    exact mode (the batch-invariant kernels, ``quant.exact``)."""
    base = fmt.removesuffix("+exact")
    return base, base != fmt


def make_engine(model: Transformer, fmt: str, config: EngineConfig, lora_rank: int = 0) -> Engine:
    """The engine of ``model`` in ``fmt`` (``+exact``: in exact mode, as ``quant.exact`` builds
    it); with ``lora_rank`` the one a LoRA run builds
    (:func:`~quarl.trainer.weights.build_lora_engine`: a frozen base in ``fmt`` with rank
    ``lora_rank`` adapters on every default target, B at zero as at step 0)."""
    fmt, exact = split_exact(fmt)
    if exact:
        from quarl.quant.kernels.invariant_model import ExactMode

        model.exact = ExactMode(config.block_size, config.kv_cache_dtype == "fp8")
    if not lora_rank:
        return Engine(model, scheme=None if fmt == "bf16" else fmt, config=config)
    from quarl.config.run import QuantConfig
    from quarl.model.lora import DEFAULT_TARGETS
    from quarl.quant.mode import QuantMode
    from quarl.quant.scheme import SCHEMES
    from quarl.trainer.weights import LoRASettings, build_lora_engine

    quant = QuantConfig(mode=QuantMode.BF16 if fmt == "bf16" else QuantMode.ALIGNED, scheme=SCHEMES[fmt])
    quant.validate()
    engine, _ = build_lora_engine(model, quant, config, LoRASettings(lora_rank, 2.0 * lora_rank, DEFAULT_TARGETS))
    return engine


def run_engine(shape: str, fmt: str, batch: int, prompt_len: int, gen_len: int, ceil: Ceilings,
               device: torch.device, seed: int = 0, engine_kw: dict | None = None,
               lora_rank: int = 0) -> dict[str, Any]:
    cfg = shape_config(shape, prompt_len + gen_len)
    model = bench_model(shape, split_exact(fmt)[0], device, prompt_len + gen_len, seed)
    t0 = time.perf_counter()
    config = EngineConfig(max_num_seqs=batch, max_model_len=prompt_len + gen_len, max_num_batched_tokens=32768,
                          **(engine_kw or {}))
    engine = make_engine(model, fmt, config, lora_rank)
    init_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=gen_len, ignore_eos=True, seed=seed)
    engine.generate(prompts[: min(batch, 8)], SamplingParams(max_new_tokens=4, ignore_eos=True))  # compile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    total_s = time.perf_counter() - t0
    st = engine.stats
    assert all(len(o.token_ids) == gen_len for o in outs)
    assert all(math.isfinite(lp) for o in outs[:4] for lp in o.logprobs)
    fl = floors(cfg, step_weight_bytes(engine.model, batch), batch, prompt_len, gen_len, ceil, config.kv_cache_dtype)
    replay_ms = float("nan")
    if engine.runner.graphs:  # GPU time of one decode step alone: the last step's inputs replayed
        graph = engine.runner.graphs[max(engine.runner.graphs)][0]
        replay_ms = 1e3 * median_cuda_time(graph.replay, 20)
    steps = sorted(st.decode_step_s)
    row = {
        "shape": shape, "format": fmt, "kv_cache_dtype": config.kv_cache_dtype, "lora_rank": lora_rank, "batch": batch,
        "dependent_launches": config.dependent_launches, "dense_weights": config.dense_weights,
        "dense_weight_bytes": engine.runner.dense_weight_bytes,
        "prompt_len": prompt_len, "gen_len": gen_len, "generated_tok_per_s": st.generated_tokens / total_s,
        "total_s": total_s, "init_s": init_s,
        "prefill_s": st.prefill_s, "prefill_steps": st.prefill_steps, "decode_s": st.decode_s,
        "decode_steps": st.decode_steps, "planned_steps": st.planned_steps, "preemptions": st.preemptions,
        "decode_step_ms_mean": 1e3 * st.decode_s / max(st.decode_steps, 1),
        "decode_step_ms_median": 1e3 * steps[len(steps) // 2] if steps else 0.0,
        "last_step_graph_replay_ms": replay_ms, "decode_tiling": list(engine.runner.decode_tiling),
        "decode_tuning_ms": engine.runner.decode_tuning_ms, "decode_tuning_table": engine.runner.decode_tuning_table,
        "fused_kernels": engine.runner.fused,
        "kv_blocks": engine.runner.num_blocks, "weight_bytes_per_step": step_weight_bytes(engine.model, batch),
        **fl,
    }
    row["decode_floor_fraction"] = fl["decode_floor_s"] / st.decode_s if st.decode_s else 0.0
    row["overall_floor_fraction"] = (fl["decode_floor_s"] + fl["prefill_floor_s"]) / total_s
    del engine, model, outs
    gc.collect()
    torch.cuda.empty_cache()
    return row


@torch.no_grad()
def run_hf(shape: str, batch: int, prompt_len: int, gen_len: int, device: torch.device,
           seed: int = 0) -> dict[str, Any]:
    """HF ``generate`` (sampling, forced length) on the same random weights."""
    import transformers

    cfg = shape_config(shape, prompt_len + gen_len)
    model = random_model(cfg, device, seed)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    state = {("" if n.startswith("lm_head") else "model.") + n: p for n, p in model.named_parameters()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing), (missing, unexpected)
    del model
    hf.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen).to(device)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0, eos_token_id=None)
    hf.generate(ids[:8], attention_mask=mask[:8], max_new_tokens=4, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=gen_len, **kw)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    new = out.shape[1] - prompt_len
    del hf, out
    gc.collect()
    torch.cuda.empty_cache()
    return {"shape": shape, "format": "hf-generate-bf16", "batch": batch, "prompt_len": prompt_len,
            "gen_len": new, "generated_tok_per_s": batch * new / total, "total_s": total}


def child_argv(shape: str, batch: int, prompt_len: int, gen_len: int, fmt: str, kv: str, lora_rank: int,
               engine_kw: dict | None, out: Path) -> list[str]:
    """``quarl bench rollout`` for one format and KV-cache dtype with these settings, its JSON
    written to ``out`` (the command a baseline comparison runs under each version)."""
    kw = engine_kw or {}
    return [sys.executable, "-m", "quarl", "bench", "rollout", "--shape", shape, "--batch", str(batch),
            "--prompt-len", str(prompt_len), "--gen-len", str(gen_len), "--formats", fmt, "--kv-cache-dtype", kv,
            "--lora-rank", str(lora_rank),
            "--dependent-launches", "on" if kw.get("dependent_launches", True) else "off",
            "--dense-weights", kw.get("dense_weights", "auto"), "--out", str(out.resolve())]


def run_child(root: Path, commit: str | None, tmp: Path, shape: str, batch: int, prompt_len: int, gen_len: int,
              fmt: str, kv: str, lora_rank: int = 0, engine_kw: dict | None = None) -> dict[str, Any]:
    """One row measured by the ``quarl`` package in ``root`` in a fresh process (run from
    ``root``: ``python -m`` puts the working directory first on the path), with the commit it
    ran; an error naming the run and its last lines when it fails or reports an error."""
    out = tmp / f"child_{abs(hash(str(root.resolve())))}_{fmt}_{kv}.json"
    argv = child_argv(shape, batch, prompt_len, gen_len, fmt, kv, lora_rank, engine_kw, out)
    proc = subprocess.run(argv, env=child_env(root, commit), cwd=root, capture_output=True, text=True)
    if (err := child_failed(proc, out, root, f"{fmt} kv={kv}")) is not None:
        raise err
    done = json.loads(out.read_text())
    row = done["rows"][0]
    if "error" in row:
        raise RuntimeError(f"the run of quarl in {root} failed on {fmt} kv={kv}: {row['error']}")
    return {**row, "git_commit": done.get("git_commit")}


def against_baseline(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the baseline's row and the speedups over it: generated tok/s, and the
    median decode step (the baseline's time over this one's)."""
    return {**row, "baseline": base,
            "speedup_vs_baseline": row["generated_tok_per_s"] / base["generated_tok_per_s"],
            "decode_step_vs_baseline": base["decode_step_ms_median"] / row["decode_step_ms_median"]}


def run_benchmark(shape: str, batch: int | list[int], prompt_len: int, gen_len: int, formats: list[str],
                  hf_gen_len: int = 0, out: str | None = None, engine_kw: dict | None = None,
                  kv_cache_dtypes: tuple[str, ...] = ("auto",), lora_rank: int = 0, baseline: Path | None = None,
                  baseline_commit: str | None = None, child=run_child) -> dict[str, Any]:
    """One row per batch size, weight format and KV-cache dtype; ``speedup_vs_bf16`` against
    the bf16 row of the same batch with the model-dtype cache (the first bf16 row of that batch
    when there is none). With ``baseline`` (a directory holding another version's ``quarl``
    package) every row runs in a fresh process, this code's then the baseline's (``child``),
    and carries the baseline's row and the speedups over it. HF generate (``hf_gen_len``) runs
    at the first batch size."""
    batches = [batch] if isinstance(batch, int) else list(batch)
    if baseline is not None:
        check_baseline(baseline)
    device = torch.device("cuda")
    ceil = measure_ceilings(device)
    torch.cuda.empty_cache()  # (children size their KV caches by the memory left free)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch, fmt, kv in ((b, f, k) for b in batches for f in formats for k in kv_cache_dtypes):
            kw = {**(engine_kw or {}), "kv_cache_dtype": kv}
            try:
                if baseline is None:
                    rows.append(run_engine(shape, fmt, batch, prompt_len, gen_len, ceil, device, engine_kw=kw,
                                           lora_rank=lora_rank))
                else:
                    args = (Path(tmp), shape, batch, prompt_len, gen_len, fmt, kv, lora_rank, engine_kw)
                    row = child(package_root(), git_commit(), *args)
                    rows.append(against_baseline(row, child(baseline, baseline_commit, *args)))
            except Exception as e:  # keep the other rows of a long run
                rows.append({"shape": shape, "format": fmt, "kv_cache_dtype": kv, "batch": batch,
                             "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            gc.collect()  # the failed engine's frames are gone with the exception; free its memory
            torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "benchmark": "rollout", "device": torch.cuda.get_device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "torch": torch.__version__,
        "ceilings": asdict(ceil), "rows": rows,
    }
    if hf_gen_len:
        hf = run_hf(shape, batches[0], prompt_len, hf_gen_len, device)
        hf["note"] = (f"HF generate ran {hf['gen_len']} new tokens (not {gen_len}); its tok/s is used as is, "
                      "which favours HF (its per-token cost grows with context)")
        result["hf"] = hf
        print(json.dumps(hf), flush=True)
        for r in rows:
            if "generated_tok_per_s" in r and r.get("batch") == batches[0]:
                r["speedup_vs_hf"] = r["generated_tok_per_s"] / hf["generated_tok_per_s"]
    for b in batches:
        here = [r for r in rows if r.get("batch") == b]
        bf16_rows = [r for r in here if r.get("format") == "bf16" and "generated_tok_per_s" in r]
        base = next((r for r in bf16_rows if r.get("kv_cache_dtype") == "auto"), bf16_rows[0] if bf16_rows else None)
        for r in here:
            if base is not None and "generated_tok_per_s" in r:
                r["speedup_vs_bf16"] = r["generated_tok_per_s"] / base["generated_tok_per_s"]
    write_json(result, out or None)
    return result


def profile_kernels(shape: str, fmt: str, batch: int, prompt_len: int, reps: int = 10, top: int = 14,
                    device: torch.device | None = None, kv_cache_dtype: str = "auto", lora_rank: int = 0,
                    engine_kw: dict | None = None) -> str:
    """Per-kernel GPU time of one decode step: the engine on random weights generates a few
    tokens, then its largest captured decode graph is replayed under torch.profiler. A table
    of the kernels by total time per step (ms, launches per step, name)."""
    from torch.profiler import ProfilerActivity, profile

    device = device or torch.device("cuda")
    cfg = shape_config(shape, prompt_len + 64)
    model = bench_model(shape, split_exact(fmt)[0], device, prompt_len + 64)
    engine = make_engine(model, fmt, EngineConfig(max_num_seqs=batch, max_model_len=prompt_len + 64,
                                                  kv_cache_dtype=kv_cache_dtype, **(engine_kw or {})), lora_rank)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len)).tolist()
    engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    graph = engine.runner.graphs[max(engine.runner.graphs)][0]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = 1e3 * median_cuda_time(graph.replay, 50)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            t, n = kernels.get(e.name[:90], (0.0, 0))
            kernels[e.name[:90]] = (t + e.device_time, n + 1)
    total_us = sum(t for t, _ in kernels.values()) / reps
    spans = [(e.name[:90], e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    gaps = idle_gaps(spans, max_gap_us=0.5 * replay_ms * 1e3)
    idle_us, before = gaps["idle_us"], gaps["before"]
    extra = "".join(f" {k}={v}" for k, v in (engine_kw or {}).items())
    lines = [f"{shape} {fmt} kv={kv_cache_dtype} lora={lora_rank}{extra} B={batch}: graph replay {replay_ms:.3f} ms "
             f"(median of 50), {total_us / 1e3:.3f} ms of kernels per step "
             f"(decode attention tiling {list(engine.runner.decode_tiling)}; "
             f"{torch.cuda.get_device_name(device)}, commit {git_commit()[:10]})"]
    for name, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / reps / 1e3:7.3f} ms  {n // reps:4d}x  {name}")
    lines.append(f"  idle between kernels: {idle_us / reps / 1e3:.3f} ms per step; the largest shares, by the kernel "
                 "that waited:")
    for name, (t, n) in sorted(before.items(), key=lambda kv: -kv[1][0])[:6]:
        lines.append(f"  {t / reps / 1e3:7.3f} ms  {n // reps:4d}x  before {name}")
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return "\n".join(lines)


def summary_table(result: dict[str, Any]) -> str:
    lines = [f"{result['device']}  bw {result['ceilings']['bandwidth'] / 1e12:.2f} TB/s  "
             f"bf16 {result['ceilings']['bf16_flops'] / 1e12:.0f} TFLOP/s"]
    lines.append("shape         fmt        kv    B   tok/s     step_ms  floor_ms  frac   x_bf16  x_hf   "
                 "last_replay_ms/floor")
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['shape']:13s} {r['format']:10s} {r.get('kv_cache_dtype', 'auto'):4s} "
                         f"ERROR {r['error'][:120]}")
            continue
        lines.append(
            f"{r['shape']:13s} {r['format']:10s} {r.get('kv_cache_dtype', 'auto'):4s} {r['batch']:4d} "
            f"{r['generated_tok_per_s']:9.0f} "
            f"{r['decode_step_ms_mean']:8.3f} {r['decode_step_floor_ms_mean']:8.3f} {r['decode_floor_fraction']:5.2f} "
            f"{r.get('speedup_vs_bf16', float('nan')):6.2f} {r.get('speedup_vs_hf', float('nan')):6.1f} "
            f"{r['last_step_graph_replay_ms']:7.3f}/{r['decode_step_floor_ms_last']:.3f} {r['decode_tiling']}"
            + (f"  dense copies {r['dense_weight_bytes'] / 1e9:.1f} GB" if r.get("dense_weight_bytes") else "")
        )
    for r in result["rows"]:
        if "baseline" in r:
            b = r["baseline"]
            lines.append(f"{r['format']} kv={r.get('kv_cache_dtype', 'auto')} against the baseline "
                         f"({str(b.get('git_commit'))[:10]}): {b['generated_tok_per_s']:.0f} -> "
                         f"{r['generated_tok_per_s']:.0f} tok/s ({r['speedup_vs_baseline']:.3f}x), median decode step "
                         f"{b['decode_step_ms_median']:.3f} -> {r['decode_step_ms_median']:.3f} ms "
                         f"({r['decode_step_vs_baseline']:.3f}x)")
    if "hf" in result:
        lines.append(f"HF generate: {result['hf']['generated_tok_per_s']:.0f} tok/s "
                     f"({result['hf']['gen_len']} new tokens)")
    return "\n".join(lines)
