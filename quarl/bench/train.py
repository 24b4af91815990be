"""End-to-end RL step benchmark: every mode on the same workload, in one call.

A workload is a model shape on random weights (from a fixed seed, saved as a local HF
directory, so each mode loads the same weights the way a user's run does), a batch shape and a
response length. Random weights never emit EOS, so every response runs to
``max_new_tokens`` and each mode decodes the same number of tokens. Each mode is a
fresh :class:`~quarl.trainer.loop.Trainer` in a fresh process over that directory whose steps are run
without checkpoints or evaluation; the numbers are medians of the steps after the workload's
warm-up (step 1 pays compilation and graph capture; a LoRA run on a low-bit base compiles its
layer regions again at step 2, once its frozen base is kept dense), the same steps in every mode.

Learner model-FLOPs utilisation is the trainer's ``perf/learner_mfu``: ``6 * P * T`` FLOPs
for a forward + backward over ``T`` tokens (``P`` = matmul parameters incl. the LM head),
plus ``2 * P * T`` per extra forward (a LoRA run: ``4 * P * T`` for its frozen base, which
gets no weight gradient, plus ``6 * P_lora * T``), over the learner time and the GPU's
measured bf16 matrix rate.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quarl.bench.common import ClockWatch, check_baseline, child_env, child_failed, package_root, write_json
from quarl.bench.profiling import PROFILED_STAGES, PROFILES, profile_call  # noqa: F401 (the CLI's choices)

# metric -> short name in the summary
KEYS = {
    "time/step": "step_s", "time/rollout": "rollout_s", "time/learner": "learner_s", "time/publish": "publish_s",
    "time/kv_cache": "kv_s", "time/grad_sync": "grad_sync_s", "time/rank_wait": "rank_wait_s",
    "rollout/tokens_per_s": "rollout_tok_s", "mismatch/kl_k3": "kl_k3",
    "mismatch/kl_k3_noreplay": "kl_k3_noreplay", "moe/route_agreement": "route_agreement",
    "moe/expert_load_max": "expert_load_max",
    "memory/rollout_peak_gb": "rollout_peak_gb", "memory/learner_peak_gb": "learner_peak_gb",
    "memory/learner_alloc_retries": "learner_alloc_retries", "memory/rollout_alloc_retries": "rollout_alloc_retries",
    "response/len_mean": "len_mean", "perf/learner_tokens": "learner_tokens", "rollout/preemptions": "preemptions",
    "perf/learner_tflops": "learner_tflops", "perf/learner_mfu": "learner_mfu", "perf/compiles": "compiles",
    "perf/compile_s": "compile_s", "perf/triton_builds": "triton_builds", "perf/gc_s": "gc_s",
    "perf/gc_full": "gc_full",
    "gpu/rollout_sm_mhz": "rollout_sm_mhz", "gpu/learner_sm_mhz": "learner_sm_mhz",
    "gpu/rollout_power_w": "rollout_power_w", "gpu/learner_power_w": "learner_power_w",
}


@dataclass(frozen=True)
class Workload:
    shape: str  # a preset of quarl.model.presets
    prompts: int
    n: int
    gen: int
    token_budget: int
    steps: int = 5
    extra: tuple[str, ...] = field(default_factory=tuple)
    # random weights made in each mode's process (--model.builtin=shape: a LoRA base is then packed one
    # linear at a time on the GPU) instead of a bf16 checkpoint saved once: shapes too big for that
    random_base: bool = False
    warmup: int = 1  # steps left out of the medians


WORKLOADS: dict[str, Workload] = {
    # the W1: ~131k generated tokens per step
    "w1": Workload("qwen2.5-1.5b", prompts=16, n=8, gen=1024, token_budget=6144),
    # W1-long: ~256k generated tokens per step; a budget that holds two rows of prompt + 4096 tokens
    # (8192 held one: two are ~8300)
    "w1-long": Workload("qwen2.5-1.5b", prompts=8, n=8, gen=4096, token_budget=8448, steps=4),
    # LoRA rank 64 on a Qwen2.5-7B-shape base, 64 rollouts x 1024 tokens (compare bf16 and aligned-w4a16)
    "lora-7b": Workload("qwen2.5-7b", prompts=8, n=8, gen=1024, token_budget=4096, steps=5, warmup=2,
                        extra=("--model.lora_rank=64",)),
    # a Qwen2.5-32B-shape w4a16 base + LoRA 64 on one GPU (its bf16 weights alone are 65 GB)
    "lora-32b": Workload("qwen2.5-32b", prompts=8, n=8, gen=1024, token_budget=4096, steps=2, random_base=True,
                         extra=("--model.lora_rank=64", "--trainer.activation_checkpointing=true",
                                "--rollout.engine.gpu_memory_utilization=0.65")),
    # a full fine-tune of the 7B shape in the lean settings (activation checkpointing, bf16 weights and
    # Adam moments with stochastic rounding: 8 bytes a parameter); run it with --modes aligned-w4a16
    # (the KV cache released through each update, micro-batches of 2048 tokens: 80 GB holds the 8 bytes a
    # parameter, the engine's w4a16 copy and little else; the engine's share of the GPU raised from the
    # trainer's 0.35 so that its KV cache holds the 64 rollouts of 1024 tokens at once, which the
    # released cache leaves the learner free to do)
    "full-7b-lean": Workload("qwen2.5-7b", prompts=8, n=8, gen=1024, token_budget=2048, steps=3,
                             extra=("--trainer.activation_checkpointing=true", "--optim.fp32_master=false",
                                    "--optim.state_dtype=bfloat16", "--rollout.kv_cache_in_update=release",
                                    "--rollout.engine.gpu_memory_utilization=0.4")),
    # a full fine-tune too big for one GPU, its learner sharded over the ranks (14B in the lean
    # settings: bf16 weights and Adam moments, 8 bytes a parameter with the gradients, 118 GB); run it
    # with --gpus 4 (prompts per GPU: 12 a step on 4 GPUs, which 2, 3 and 6 GPUs divide too)
    "full-14b-sharded": Workload("qwen2.5-14b", prompts=3, n=8, gen=1024, token_budget=4096, steps=3,
                                 random_base=True,
                                 extra=("--trainer.shard_learner=true", "--trainer.activation_checkpointing=true",
                                        "--optim.fp32_master=false", "--optim.state_dtype=bfloat16",
                                        "--rollout.kv_cache_in_update=release",
                                        "--rollout.engine.gpu_memory_utilization=0.45")),
    # a quick check that everything runs (seconds per mode on a GPU)
    "smoke": Workload("100m", prompts=8, n=4, gen=64, token_budget=4096, steps=3),
    # a Qwen3-30B-A3B-shape base (128 experts, 8 per token, 61 GB in bf16) + LoRA 64 on attention, 64
    # rollouts x 1024 tokens: the bf16 base fits one H200, a w4a16 base one 80 GB H100 (packed as made)
    "moe-30b-lora": Workload("qwen3-30b-a3b", prompts=8, n=8, gen=1024, token_budget=4096, steps=3, random_base=True,
                             extra=("--model.lora_rank=64", "--trainer.activation_checkpointing=true",
                                    "--rollout.engine.gpu_memory_utilization=0.6")),
    # a full fine-tune of the Qwen3-30B-A3B shape (30.5B parameters, 3.0B active a token) in the lean
    # settings, its learner sharded over the ranks; run it with --gpus 4 (H200s) or --gpus 8, modes
    # aligned-w4a16+r3 and bf16 (docs/distributed.md, "Qwen3-30B-A3B on several GPUs"). Per GPU, GiB:
    # learner state 30.5B x 8 bytes = 227 / N (the 2 bytes of gradients only in the update, the 4 of
    # Adam moments from step 1 on) + the engine's replicated copy (w4a16 15.5, bf16 57) + KV (96 KiB a
    # token; 48 answers of ~1090 tokens: 4.8) + the update's transients (~10-15, estimated) + context.
    # KV released through the update: w4a16 ~87 on 4 GPUs (H200s), ~59 on 8; bf16 ~127 on 4, ~99 on 8
    # (H200s). Setup holds more: each rank makes the whole bf16 base and the engine's bf16 copy of it
    # (114) before sharding, which no H100 holds yet. The engine sizes its cache after sharding
    # (2 bytes a parameter / N and its own weights held): 0.6 of the GPU leaves >= 8 of KV wherever
    # the run fits, with room for the moments added at step 1. 6 prompts a GPU: 24 a step on 4 GPUs,
    # 48 on 8, which 3 and 6 GPUs divide too (a resume on another count). 2 steps (the first compiles)
    "moe-30b-full-sharded": Workload("qwen3-30b-a3b", prompts=6, n=8, gen=1024, token_budget=4096, steps=2,
                                     random_base=True,
                                     extra=("--trainer.shard_learner=true", "--trainer.activation_checkpointing=true",
                                            "--optim.fp32_master=false", "--optim.state_dtype=bfloat16",
                                            "--rollout.kv_cache_in_update=release",
                                            "--rollout.engine.gpu_memory_utilization=0.6")),
    # a small MoE (moe-100m: 32 experts, 4 per token) through whole steps: compare bf16, aligned modes
    # and routing replay (+r3) by step time, kl_k3 and route agreement
    "moe-small": Workload("moe-100m", prompts=8, n=8, gen=256, token_budget=4096, steps=4),
}

MODES: dict[str, list[str]] = {
    "bf16": ["--quant.mode=bf16"],
    "aligned-w4a16": ["--quant.mode=aligned", "--quant.scheme=w4a16"],
    "rollout-w4a16": ["--quant.mode=rollout", "--quant.scheme=w4a16"],
    "aligned-w8a8-fp8": ["--quant.mode=aligned", "--quant.scheme=w8a8-fp8"],
    "aligned-w8a8-int8": ["--quant.mode=aligned", "--quant.scheme=w8a8-int8"],
}


# options a mode name may add after a '+' (e.g. aligned-w4a16+kvfp8): per mode, unlike the
# extra --section.key=value flags, which go to every mode (the bf16 baseline included)
MODE_OPTIONS: dict[str, list[str]] = {
    "kvfp8": ["--rollout.engine.kv_cache_dtype=fp8"],
    "dense": ["--rollout.engine.dense_weights=on"],
    "r3": ["--rollout.routing_replay=r3"],  # MoE: the learner replays the engine's expert choices
    "exact": ["--quant.exact=true"],  # the batch-invariant kernels on both sides (docs/configuration.md)
    # with +exact: the update forward under autograd instead of recomputing each layer (quant.exact_update)
    "autograd": ["--quant.exact_update=autograd"],
}


def mode_overrides(mode: str) -> list[str]:
    """The run-config flags of a mode name: a key of :data:`MODES`, then any ``+option`` of
    :data:`MODE_OPTIONS`; a ValueError names the choices for anything else."""
    base, *options = mode.split("+")
    if base not in MODES:
        raise ValueError(f"unknown mode {base!r} in {mode!r}; choose from {', '.join(MODES)}")
    bad = [o for o in options if o not in MODE_OPTIONS]
    if bad:
        raise ValueError(f"unknown mode option(s) {', '.join(bad)} in {mode!r}; choose from "
                         f"{', '.join('+' + o for o in MODE_OPTIONS)}")
    return MODES[base] + [flag for o in options for flag in MODE_OPTIONS[o]]


def workload_overrides(w: Workload, model_dir: Path | None) -> list[str]:
    source = f"--model.path={model_dir}" if model_dir is not None else f"--model.builtin={w.shape}"
    return [
        source, "--model.tokenizer=builtin", "--trainer.sft_warmup_steps=0", "--data.task=arith",
        f"--trainer.prompts_per_step={w.prompts}", f"--rollout.n={w.n}", f"--rollout.max_new_tokens={w.gen}",
        f"--trainer.token_budget={w.token_budget}", f"--trainer.steps={w.steps}", "--algo.loss=tbpo",
        "--optim.lr=1e-6", "--optim.fp32_master=true", "--trainer.eval_every=0", "--trainer.save_every=0",
        "--trainer.tensorboard=false", "--data.reward_workers=0", *w.extra,
    ]


def save_random_model(shape: str, out: Path) -> Path:
    from quarl.model.loading import save_model
    from quarl.model.presets import build_random_model

    save_model(build_random_model(shape, dtype=torch.bfloat16), out)
    return out


def median_metrics(rows: list[dict[str, Any]], warmup: int = 1) -> dict[str, float]:
    """Medians of the metrics over the steps after the first ``warmup`` (all steps if none is left)."""
    steady = rows[warmup:] or rows
    out = {}
    for key, short in KEYS.items():
        vals = [r[key] for r in steady if r.get(key) is not None]
        if vals:
            out[short] = statistics.median(vals)
    return out


def run_mode(name: str, overrides: list[str], run_dir: Path, profile: str | None = None,
             stage: str = "learner") -> tuple[list[dict[str, Any]], str]:
    """One mode's steps (the metrics of each), without checkpoints or evaluation, and with
    ``profile`` (one of :data:`PROFILES`) that table of the last step's ``stage`` (one of
    :data:`PROFILED_STAGES`; else "")."""
    from quarl.config import load_run_config
    from quarl.trainer.loop import Trainer
    from quarl.trainer.stages import current_stage

    if stage not in PROFILED_STAGES:
        raise ValueError(f"the profiled stage must be one of {', '.join(PROFILED_STAGES)}, got {stage!r}")
    cfg = load_run_config(None, overrides + [f"--trainer.run_dir={run_dir}"])
    trainer = Trainer(cfg)
    rows, table = [], ""

    def label():  # what the run does now, for the GPU clock readings: (stage, step)
        now = current_stage()
        return None if now is None else (now, trainer.step + 1)

    with ClockWatch(interval=STAGE_CLOCK_INTERVAL, label=label) as watch:
        for i in range(cfg.trainer.steps):  # the steps alone: no checkpoint (GBs for a 1.5B model) or eval
            if profile and i == cfg.trainer.steps - 1:
                owner, attr = (trainer, "update_policy") if stage == "learner" else (trainer.publisher, "publish")
                call = getattr(owner, attr)
                holder: dict[str, str] = {}

                def profiled(*args, call=call, holder=holder):
                    result, holder["table"] = profile_call(lambda: call(*args), f"{name} {stage}", what=profile)
                    return result

                setattr(owner, attr, profiled)
                metrics = trainer.train_step()
                delattr(owner, attr)
                table = holder["table"]
            else:
                metrics = trainer.train_step()
            trainer.step += 1
            rows.append({"step": trainer.step, **metrics})
    add_stage_clocks(rows, watch.by_label())
    trainer.rewards.close()
    trainer = None  # frees the run's memory before the next (not del: the label closure above names it)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, table


STAGE_CLOCK_INTERVAL = 0.5  # seconds between the stage-tagged clock readings of an in-process run


def add_stage_clocks(rows: list[dict[str, Any]], by_label: dict[str, dict[str, Any]]) -> None:
    """Into each step's row, the median SM clock and power of the readings taken in each of
    its stages (``gpu/learner_sm_mhz``, ``gpu/learner_power_w``, ...), where there were any."""
    for stage, seen in by_label.items():
        for row in rows:
            for metric in ("sm_mhz", "power_w"):
                if (v := seen[f"{metric}_by_step"].get(str(row["step"]))) is not None:
                    row[f"gpu/{stage}_{metric}"] = v


def check_workload(workload: str, modes: list[str]) -> Workload:
    """The workload of that name, once every mode is known (else a ValueError naming the choices)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    for m in modes:
        mode_overrides(m)
    return WORKLOADS[workload]


def child_command(workload: str, mode: str, extra: list[str], root: Path, commit: str | None, out: Path,
                  profile: str | None = None, model: Path | None = None,
                  stage: str = "learner", gpus: int = 1) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run ``mode`` of ``workload`` with the ``quarl`` package in
    ``root`` in a child process (run from ``root``: ``python -m`` puts the working directory
    first on the path), its JSON written to ``out``; ``model``: the saved weights to run on;
    ``gpus`` > 1: that many ranks under ``torchrun`` (rank 0 writes the JSON)."""
    launch = [sys.executable] if gpus == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}"]
    argv = [*launch, "-m", "quarl", "bench", "train", "--workload", workload, "--modes", mode,
            "--out", str(out.resolve()), *(["--profile", profile, "--profile-stage", stage] if profile else []),
            *(["--model", str(model.resolve())] if model else []), *extra]
    return argv, child_env(root, commit)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(workload: str, mode: str, extra: list[str], root: Path, commit: str | None, tmp: Path,
              profile: str | None = None, model: Path | None = None, stage: str = "learner",
              gpus: int = 1) -> dict[str, Any]:
    """One mode of the benchmark run by the ``quarl`` package in ``root`` in a fresh process that
    has the GPU to itself (``gpus`` > 1: as many ranks, one per GPU): its medians, steps, commit
    (and profile table). A run that fails (a baseline that does not know the mode, say) is an
    error naming it and its last lines."""
    out = tmp / f"child_{abs(hash(str(root.resolve())))}_{mode}_{gpus}.json"
    argv, env = child_command(workload, mode, extra, root, commit, out, profile, model, stage, gpus)
    with ClockWatch() as clocks:  # (a run slowed by a GPU clocking down shows in its "gpu_clocks")
        proc = subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True)
    if (err := child_failed(proc, out, root, mode)) is not None:
        raise err
    done = json.loads(out.read_text())
    got = done["modes"][mode]
    return {"median": got["median"], "git_commit": done.get("git_commit"), "device": done.get("device"),
            "bf16_tflops_measured": done.get("bf16_tflops_measured"),
            **{k: got[k] for k in ("steps", "overrides", "profile") if k in got},
            **({"gpu_clocks": seen} if (seen := clocks.summary()) else {})}


def clock_line(name: str, run: dict[str, Any]) -> str:
    """The GPU clocks during a run (:class:`ClockWatch`), one phrase per GPU; "" without them."""
    clocks = run.get("gpu_clocks")
    if not clocks:
        return ""
    return f"{name} GPU clocks while busy: " + "; ".join(
        f"GPU {g} median {c['sm_mhz_median']:.0f} MHz of {c['sm_mhz_max']:.0f} (lowest {c['sm_mhz_min']:.0f}), "
        f"hottest {c['temp_c_max']:.0f} C, clock-event reasons {c['reasons']}" for g, c in clocks.items())


def stage_clock_line(name: str, run: dict[str, Any], stages: tuple[str, ...] = ("rollout", "learner")) -> str:
    """Each stage's time, SM clock and power step by step (:func:`add_stage_clocks`), so that a
    stage slowing down with its clock shows beside it; "" without clock readings."""
    parts = []
    for stage in stages:
        seen = [(r["step"], r.get(f"time/{stage}"), r[f"gpu/{stage}_sm_mhz"], r[f"gpu/{stage}_power_w"])
                for r in run.get("steps", []) if f"gpu/{stage}_sm_mhz" in r]
        if seen:
            parts.append(f"{stage} " + " ".join(f"{t}:" + ("" if sec is None else f"{sec:.2f}s/")
                                                + f"{mhz:.0f}MHz/{w:.0f}W" for t, sec, mhz, w in seen))
    builds = [f"{r['step']}:{r['perf/triton_builds']:.0f}" for r in run.get("steps", []) if "perf/triton_builds" in r]
    if parts and builds:  # (kernels built inside a step's stages: compile time in its timings)
        parts.append("Triton kernels built " + " ".join(builds))
    return f"{name} by step: " + "; ".join(parts) if parts else ""


def print_clocks(name: str, run: dict[str, Any]) -> None:
    for line in (clock_line(name, run), stage_clock_line(name, run)):
        if line:
            print(line, flush=True)


def check_model(model: Path, workload: Workload) -> Path:
    """``model`` as a saved checkpoint of the workload's shape (a ValueError naming the
    mismatch otherwise)."""
    from quarl.model.config import TransformerConfig
    from quarl.model.presets import preset_config

    if not (model / "config.json").is_file():
        raise ValueError(f"--model {model}: no config.json there; pass a checkpoint directory "
                         "(or leave --model out for random weights of the workload's shape)")
    got = TransformerConfig.from_hf_dict(json.loads((model / "config.json").read_text()), str(model / "config.json"))
    want = preset_config(workload.shape)
    if got.matmul_params != want.matmul_params:
        raise ValueError(f"--model {model} has {got.matmul_params:,} matmul parameters, the workload's shape "
                         f"{workload.shape} {want.matmul_params:,}: its numbers would not compare with the workload's")
    return model


def run_benchmark(workload: str, modes: list[str], extra: list[str], out: Path | None,
                  profile: str | None = None, baseline: Path | None = None,
                  baseline_commit: str | None = None, model: Path | None = None,
                  profile_stage: str = "learner", gpus: list[int] | None = None,
                  resume: bool = False) -> dict[str, Any]:
    """Every mode of ``workload``. One mode runs in this process; several run one after
    another, each in a fresh child process with the GPU to itself, so that no mode inherits
    memory, caches or compiled state from the one before.
    With ``baseline`` (a directory holding another version's ``quarl`` package) each mode then
    runs again under that code, so that old and new are measured in one call.
    With ``gpus`` (e.g. ``[1, 2, 4]``) each mode runs once per count, under ``torchrun`` with
    that many ranks and the workload's prompts per GPU (weak scaling: ``prompts x count``
    prompts a step), as ``<mode>@<count>gpu``; :func:`save_result` adds each count's
    scaling efficiency (the one-GPU step time over its own; and its rollout's alone).
    With ``resume`` the runs already in ``out`` (a call cut short: the result is saved after
    each run) are kept and only the missing ones run; :func:`resumed` checks that the file
    is of the same workload, commit and flags."""
    from quarl.bench.common import git_commit
    from quarl.model.presets import preset_config

    w = check_workload(workload, modes)
    if baseline is not None:
        check_baseline(baseline)
    if model is not None:
        check_model(model, w)
    isolate = len(modes) > 1 or baseline is not None
    spawn = isolate or bool(gpus)
    result: dict[str, Any] = {
        "benchmark": "train_step", "workload": workload, "workload_spec": w.__dict__ | {"extra": list(w.extra)},
        "device": None, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "torch": torch.__version__, "bf16_tflops_measured": None,
        "matmul_params": preset_config(w.shape).matmul_params, "extra": list(extra), "modes": {},
    }
    if resume:
        result = resumed(result, out)
    if not spawn:
        _measure_this_gpu(result)
    # else this process leaves the GPUs alone (a CUDA context here would take a GB from the runs'
    # first GPU): the device and its measured bf16 rate come from the first run's own result
    main = os.environ.get("RANK", "0") == "0"  # (under torchrun: rank 0 reports)
    with tempfile.TemporaryDirectory(prefix="quarl_bench_train_") as tmp:
        # the random weights are made and saved once (seconds of CPU for a 1.5B model) and every
        # mode's process loads them
        model_dir = model or (None if w.random_base else save_random_model(w.shape, Path(tmp) / "model"))
        for mode in modes:
            if gpus:
                _run_gpu_counts(result, w, mode, extra, gpus, Path(tmp), out, profile, model_dir, profile_stage)
                continue
            if mode in result["modes"]:  # (resumed)
                r = result["modes"][mode]
            elif isolate:
                r = result["modes"][mode] = run_child(workload, mode, extra, package_root(), git_commit(), Path(tmp),
                                                      profile, model_dir, profile_stage)
            else:
                overrides = workload_overrides(w, model_dir) + mode_overrides(mode) + extra
                rows, table = run_mode(mode, overrides, Path(tmp) / mode, profile, profile_stage)
                timed = rows[:-1] if table else rows  # the profiled step runs slower
                r = result["modes"][mode] = {"median": median_metrics(timed, w.warmup), "steps": rows,
                                             "overrides": overrides}
                if table:
                    r["profile"] = table.splitlines()
            if not main:
                continue
            if "profile" in r:
                print("\n".join(r["profile"]), flush=True)
            print(mode, json.dumps(r["median"]), flush=True)
            print_clocks(mode, r)
            save_result(result, out)  # after every mode: a call cut short keeps the modes it finished
            if baseline is not None and "baseline" not in r:
                r["baseline"] = run_child(workload, mode, extra, baseline, baseline_commit, Path(tmp))
                print(mode, "baseline", json.dumps(r["baseline"]["median"]), flush=True)
                save_result(result, out)
    return result


def _measure_this_gpu(result: dict[str, Any]) -> None:
    """The runs go in this process: its GPU's name and measured bf16 rate go in ``result``."""
    from quarl.bench.timing import measure_ceilings

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # (under torchrun: this rank's GPU)
    torch.cuda.set_device(device)
    result["device"] = torch.cuda.get_device_name(device)
    result["bf16_tflops_measured"] = measure_ceilings(device).bf16_flops / 1e12
    torch.cuda.empty_cache()  # (the engine sizes its KV cache from the memory free on the device)


def _run_gpu_counts(result: dict[str, Any], w: Workload, mode: str, extra: list[str], gpus: list[int], tmp: Path,
                    out: Path | None, profile: str | None, model_dir: Path | None, profile_stage: str) -> None:
    """``mode`` once per GPU count in ``gpus`` (``<mode>@<count>gpu``, weak scaling), each in a
    child process under ``torchrun``; the counts already in ``result`` (resumed) are kept."""
    from quarl.bench.common import git_commit

    for k in gpus:
        key = f"{mode}@{k}gpu"
        if key in result["modes"]:
            continue
        flags = [*extra, f"--trainer.prompts_per_step={w.prompts * k}"]
        result["modes"][key] = run_child(result["workload"], mode, flags, package_root(), git_commit(), tmp,
                                         profile, model_dir, profile_stage, gpus=k)
        print(key, json.dumps(result["modes"][key]["median"]), flush=True)
        print_clocks(key, result["modes"][key])
        save_result(result, out)


def resumed(fresh: dict[str, Any], out: Path | None) -> dict[str, Any]:
    """The result saved at ``out`` to continue (``fresh`` when there is none yet), provided it
    is of the same workload, commit and extra flags as ``fresh``; a ValueError naming what
    differs otherwise (its runs would not compare with the new ones)."""
    if out is None:
        raise ValueError("--resume continues the result file named by --out; pass --out")
    if not out.is_file():
        return fresh
    saved = json.loads(out.read_text())
    differ = [k for k in ("workload", "git_commit", "extra") if saved.get(k) != fresh[k]]
    if differ:
        got = "; ".join(f"{k}: {saved.get(k)!r} there, {fresh[k]!r} now" for k in differ)
        raise ValueError(f"--resume: {out} is another benchmark's result ({got}); "
                         "write to another --out or rerun with the same code and flags")
    return saved


def save_result(result: dict[str, Any], out: Path | None) -> None:
    """Adds the speedups (over bf16, over the baseline) to ``result`` and writes it to ``out``
    atomically (a temporary file renamed over it)."""
    modes = result["modes"]
    for key in ("device", "bf16_tflops_measured"):  # (a parent of child runs: the first run's)
        if result.get(key) is None:
            result[key] = next((r[key] for r in modes.values() if r.get(key) is not None), None)
    for key, r in modes.items():
        mode, _, count = key.partition("@")
        m = r["median"]
        r["speedup_vs_bf16"] = _speedups(modes.get("bf16" + ("@" + count if count else ""), {}).get("median", {}), m)
        one = modes.get(f"{mode}@1gpu", {}).get("median", {})
        if count and one.get("step_s") and m.get("step_s"):  # the same work per GPU: ideally the same step time
            r["scaling_efficiency"] = one["step_s"] / m["step_s"]
        if count and one.get("rollout_s") and m.get("rollout_s"):  # the engines' part alone (each rank its own)
            r["rollout_scaling_efficiency"] = one["rollout_s"] / m["rollout_s"]
        if "baseline" in r:
            r["speedup_vs_baseline"] = _speedups(r["baseline"]["median"], m)
    write_json(result, out)


def _speedups(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``before / after`` of the step, rollout and learner times both have."""
    return {k: before[k] / after[k] for k in ("step_s", "rollout_s", "learner_s") if before.get(k) and after.get(k)}


def summary_table(result: dict[str, Any]) -> str:
    """The markdown table of a result; with a baseline, one row per mode for the baseline's
    run under it and the new code's speedup over it (step / rollout / learner)."""
    with_base = any("baseline" in r for r in result["modes"].values())
    head = "| mode | step s | rollout | learner | publish | KV | tok/s | kl_k3 | learner MFU | peak GB | step speedup |"
    head += " vs baseline (step / rollout / learner) |" if with_base else ""
    lines = [f"{result['workload']} on {result['device']} at {result['git_commit'][:7]}", head,
             "|" + "---|" * (12 if with_base else 11)]

    def row(label: str, m: dict[str, float], speedup: dict[str, float], vs_base: str | None) -> str:
        peak = max(m.get("rollout_peak_gb", 0.0), m.get("learner_peak_gb", 0.0))
        step_speedup = f"{speedup['step_s']:.2f}x" if "step_s" in speedup else "-"
        line = (f"| {label} | {m.get('step_s', 0):.2f} | {m.get('rollout_s', 0):.2f} | {m.get('learner_s', 0):.2f} | "
                f"{m.get('publish_s', 0):.2f} | {m.get('kv_s', 0):.2f} | {m.get('rollout_tok_s', 0) / 1e3:.1f}k | "
                f"{m.get('kl_k3', float('nan')):.2e} | {m.get('learner_mfu', 0):.1%} | {peak:.1f} | "
                f"{step_speedup} |")
        return line + (f" {vs_base} |" if vs_base is not None else "")

    scaling = [f"{mode}: {r['scaling_efficiency']:.0%}" + (f" (rollout {r['rollout_scaling_efficiency']:.0%})"
                                                          if "rollout_scaling_efficiency" in r else "")
               for mode, r in result["modes"].items() if "scaling_efficiency" in r and not mode.endswith("@1gpu")]
    for mode, r in result["modes"].items():
        vs = r.get("speedup_vs_baseline")
        cell = None if not with_base else "-" if vs is None else " / ".join(
            f"{vs.get(k, float('nan')):.2f}x" for k in ("step_s", "rollout_s", "learner_s"))
        lines.append(row(mode, r["median"], r.get("speedup_vs_bf16", {}), cell))
        if "baseline" in r:
            lines.append(row(f"{mode} (baseline {str(r['baseline'].get('git_commit'))[:7]})", r["baseline"]["median"],
                             {}, ""))
    if scaling:  # weak scaling: the one-GPU step time over the step time with the same prompts per GPU
        lines.append("scaling efficiency vs 1 GPU: " + ", ".join(scaling))
    return "\n".join(lines)
