"""``quarl bench learner``: the learner's micro-batch alone, timed by the host and by the GPU.

One micro-batch is what :class:`~quarl.learner.Learner` runs per ``token_budget`` tokens: the
log-probs of ``tokens / seq_len`` right-padded rows through the compiled layer regions (as the
learner's forward runs them on CUDA) and the backward of a weighted sum of them, its gradients
accumulated into the weights' ``.grad`` as gradient accumulation does. Per micro-batch it
reports the host's time (until the backward call returns), the wall time (CUDA events), the
GPU's kernel time, launches and idle time between kernels (torch.profiler over one more
repeat), and the host's time over the kernels'. The idle time is the direct measure: a host
whose launches fill the queue is throttled to the GPU's pace, so host ~ kernels alone does not
say the host is slow (docs/performance.md); a host that falls behind leaves long gaps. The
optimizer step and fp32 master weights are not in it (``quarl bench train`` times the whole
step). Random weights of a preset shape, optionally fewer layers; each mode, and with a
baseline each mode under that code too, in a process of its own.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from quarl.bench.common import check_baseline, child_env, child_failed, package_root, write_json

# mode -> the aligned (QAT) scheme of its linears (None: bf16)
MODES: dict[str, str | None] = {"bf16": None, "aligned-w4a16": "w4a16", "aligned-w8a8-fp8": "w8a8-fp8",
                                "aligned-w8a8-int8": "w8a8-int8"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one run measures: ``layers`` of the ``shape`` preset (None: all), micro-batches of
    ``tokens`` tokens in rows of ``seq_len``, ``micro_batches`` per timed repeat, ``reps`` repeats
    after ``warmup``; ``compiled``: the learner's compiled regions (off: its eager ops)."""

    shape: str = "qwen2.5-1.5b"
    layers: int | None = None
    tokens: int = 6144
    seq_len: int = 1024
    micro_batches: int = 4
    reps: int = 12
    warmup: int = 2
    compiled: bool = True

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.tokens < self.seq_len:
            raise ValueError(f"--tokens {self.tokens} / --seq-len {self.seq_len}: a micro-batch holds at least one "
                             "row of at least 2 tokens (tokens >= seq_len >= 2)")
        if min(self.micro_batches, self.reps) < 1 or self.warmup < 0 or (self.layers is not None and self.layers < 1):
            raise ValueError("--micro-batches, --reps and --layers must be at least 1, --warmup at least 0")


def check_mode(mode: str) -> str | None:
    """The scheme of ``mode`` (a ValueError naming the modes otherwise)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return MODES[mode]


def build(cfg, scheme: str | None, spec: Spec, device: torch.device, seed: int = 0):
    """The model (:func:`~quarl.model.presets.build_random_model`'s weights, in bf16 on
    ``device``; aligned linears for ``scheme``) and one micro-batch's inputs: ids, mask and
    the log-probs' weights."""
    from quarl.model.presets import build_random_model
    from quarl.quant import QATLinear, quantize_model

    model = build_random_model(cfg, seed, torch.bfloat16, device)
    if scheme is not None:
        quantize_model(model, scheme, QATLinear)
    rows = spec.tokens // spec.seq_len
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (rows, spec.seq_len), device=device, generator=gen)
    mask = torch.ones_like(ids)
    weights = torch.randn(rows, spec.seq_len - 1, device=device, generator=gen)
    return model, ids, mask, weights


def run_micro_batch(model, ids: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, ops) -> None:
    """One micro-batch: the learner's log-probs, then the backward of their weighted sum."""
    from quarl.learner.logprobs import sequence_logprobs

    lp, _ = sequence_logprobs(model, ids, mask, right_padded=True, ops=ops)
    (lp * weights).sum().backward()


def measure(cfg, scheme: str | None, spec: Spec, device: torch.device, profile: str | None = None) -> dict[str, Any]:
    """Per micro-batch, ms: host (median, min), wall (median, min, max and every repeat's),
    kernels and launches (CUDA), the host's time over the kernels', and the peak memory.
    ``profile`` (``kernels`` | ``host``): also that table of one more repeat
    (:func:`quarl.bench.profiling.profile_call`), as ``profile`` lines."""
    from quarl.learner.compiled_ops import COMPILED_OPS
    from quarl.model.transformer import TORCH_OPS

    model, ids, mask, weights = build(cfg, scheme, spec, device)
    ops = COMPILED_OPS if spec.compiled else TORCH_OPS
    cuda = device.type == "cuda"

    def repeat() -> None:
        for p in model.parameters():  # (an update's first micro-batch takes its gradients, the others add)
            p.grad = None
        for _ in range(spec.micro_batches):
            run_micro_batch(model, ids, mask, weights, ops)

    for _ in range(spec.warmup):
        repeat()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    hosts, walls = [], []
    for _ in range(spec.reps):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        repeat()
        hosts.append((time.perf_counter() - t0) * 1e3 / spec.micro_batches)
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            walls.append(start.elapsed_time(end) / spec.micro_batches)
        else:
            walls.append(hosts[-1])
    out: dict[str, Any] = {
        "host_ms": statistics.median(hosts), "host_ms_min": min(hosts), "wall_ms": statistics.median(walls),
        "wall_ms_min": min(walls), "wall_ms_max": max(walls), "walls_ms": [round(w, 3) for w in walls],
        "fallbacks": getattr(ops, "fallbacks", 0), "kernels_ms": None, "launches": None, "host_over_kernels": None,
        "idle_ms": None, "idle_long_ms": None,
        "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    }
    if cuda:
        kernels_ms, launches, gaps = _kernel_time(repeat, device)
        out.update(kernels_ms=kernels_ms / spec.micro_batches, launches=launches / spec.micro_batches,
                   idle_ms=gaps["idle_us"] / 1e3 / spec.micro_batches,
                   idle_long_ms=gaps["bins"][-1][0] / 1e3 / spec.micro_batches)
        out["host_over_kernels"] = out["host_ms"] / out["kernels_ms"]
    if profile is not None:
        from quarl.bench.profiling import profile_call

        _, table = profile_call(repeat, f"{spec.micro_batches} micro-batches", what=profile)
        out["profile"] = table.splitlines()
    return out


def _kernel_time(fn, device: torch.device) -> tuple[float, int, dict[str, Any]]:
    """The GPU's kernel time (ms), kernel count and idle gaps (:func:`~quarl.bench.common.idle_gaps`)
    of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    from quarl.bench.common import idle_gaps
    from quarl.bench.profiling import gpu_kernels

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels = gpu_kernels(prof).values()
    gaps = idle_gaps([(e.name[:60], e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type.name == "CUDA"])
    return sum(t for t, _ in kernels) / 1e3, int(sum(n for _, n in kernels)), gaps


def model_config(spec: Spec):
    """The preset's config with ``spec.layers`` decoder layers."""
    from quarl.model.presets import preset_config

    cfg = preset_config(spec.shape)
    return cfg if spec.layers is None else dataclasses.replace(cfg, num_hidden_layers=spec.layers)


def run_benchmark(modes: list[str], spec: Spec, out: Path | None = None, baseline: Path | None = None,
                  baseline_commit: str | None = None, profile: str | None = None) -> dict[str, Any]:
    """Every mode (each in a process of its own when there are several or a baseline; with
    ``baseline``, a directory holding another version's ``quarl`` package, each mode then also
    under that code; ``profile``: each run's table, see :func:`measure`). The result is
    written to ``out`` after every run."""
    from quarl.bench.common import git_commit

    for m in modes:
        check_mode(m)
    if baseline is not None:
        check_baseline(baseline)
    cfg = model_config(spec)
    result: dict[str, Any] = {
        "benchmark": "learner_micro_batch", "spec": dataclasses.asdict(spec), "layers": cfg.num_hidden_layers,
        "device": None, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "torch": torch.__version__, "modes": {},
    }
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    isolate = len(modes) > 1 or baseline is not None
    with tempfile.TemporaryDirectory(prefix="quarl_bench_learner_") as tmp:
        for mode in modes:
            if isolate:
                r = result["modes"][mode] = run_child(mode, spec, package_root(), git_commit(), Path(tmp), profile)
            else:
                r = result["modes"][mode] = measure(cfg, MODES[mode], spec, device, profile)
                r["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            result["device"] = result["device"] or r.get("device")
            print("\n".join(r.get("profile", [])), flush=True)
            print(mode, json.dumps({k: v for k, v in r.items() if k not in ("walls_ms", "profile")}), flush=True)
            write_json(result, out)
            if baseline is not None:
                r["baseline"] = run_child(mode, spec, baseline, baseline_commit, Path(tmp), profile)
                r["vs_baseline"] = {k: r["baseline"][k] / r[k] for k in ("host_ms", "wall_ms") if r[k]}
                write_json(result, out)
    return result


def run_child(mode: str, spec: Spec, root: Path, commit: str | None, tmp: Path,
              profile: str | None = None) -> dict[str, Any]:
    """``mode`` measured by the ``quarl`` package in ``root`` in a fresh process (an error naming
    the run and its last lines when it fails)."""
    out = tmp / f"child_{abs(hash(str(root.resolve())))}_{mode}.json"
    argv = [sys.executable, "-m", "quarl", "bench", "learner", "--modes", mode, "--out", str(out.resolve()),
            "--shape", spec.shape, "--tokens", str(spec.tokens), "--seq-len", str(spec.seq_len),
            "--micro-batches", str(spec.micro_batches), "--reps", str(spec.reps), "--warmup", str(spec.warmup),
            *(["--layers", str(spec.layers)] if spec.layers is not None else []),
            *([] if spec.compiled else ["--eager"]), *(["--profile", profile] if profile else [])]
    proc = subprocess.run(argv, env=child_env(root, commit), cwd=root, capture_output=True, text=True)
    if (err := child_failed(proc, out, root, mode)) is not None:
        raise err
    done = json.loads(out.read_text())
    return {**done["modes"][mode], "git_commit": done.get("git_commit")}


def summary_table(result: dict[str, Any]) -> str:
    """The markdown table of a result (one row per mode, and per baseline run)."""
    head = ("| mode | host ms | wall ms (min-max) | kernels ms | launches | GPU idle ms (gaps >= 50 us) "
            "| host / kernels | peak GB | vs baseline (host / wall) |\n|---|---|---|---|---|---|---|---|---|")

    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    def row(name: str, r: dict[str, Any], vs: str = "") -> str:
        return (f"| {name} | {fmt(r['host_ms'])} | {fmt(r['wall_ms'])} "
                f"({fmt(r['wall_ms_min'])}-{fmt(r['wall_ms_max'])}) | "
                f"{fmt(r['kernels_ms'])} | {fmt(r['launches'], '.0f')} | "
                f"{fmt(r.get('idle_ms'))} ({fmt(r.get('idle_long_ms'))}) | "
                f"{fmt(r['host_over_kernels'], '.2f')} | "
                f"{fmt(r['peak_gb'])} | {vs} |")

    lines = [f"learner micro-batch of {result['spec']['tokens']} tokens, {result['layers']} layers of "
             f"{result['spec']['shape']} on {result['device']} at {str(result['git_commit'])[:7]}", head]
    for mode, r in result["modes"].items():
        vs = r.get("vs_baseline")
        lines.append(row(mode, r, f"{vs['host_ms']:.2f}x / {vs['wall_ms']:.2f}x" if vs else ""))
        if "baseline" in r:
            lines.append(row(f"{mode} (baseline {str(r['baseline'].get('git_commit'))[:7]})", r["baseline"]))
    return "\n".join(lines)
