"""A suite: a directory of run configs, trained over several seeds on one machine.

``experiments/<suite>/suite.yaml`` describes it::

    title: Mismatch by mode            # the results page's heading
    about: what claim the suite tests  # markdown, printed under the heading
    base: ../base.yaml                 # the base model's recipe (optional): warm-started once
    seeds: [0, 1, 2]                   # trainer.seed of each repeat
    parallel: 4                        # runs at once (processes sharing the GPU)
    common: [../rl.yaml, {trainer: {steps: 40}}]  # config every run shares (files and mappings)
    baseline: bf16                     # the run the ratio columns divide by
    table:                             # the summary columns
      - {metric: eval/acc, at: last}
      - {metric: time/step, at: median, tail: 4, ratio: true, without: perf/compiles}
    plots:                             # one figure per entry: a title and its metrics
      - {title: Reward and accuracy, metrics: [reward/mean, eval/acc]}

and every other ``*.yaml`` beside it is one run's config (its name is the file's stem).
A run's config is, in order of precedence: the command line's flags, the run's file,
``common``, the base recipe (its model, data and rollout sections), so that every run
decodes the same task with the same base model. With a base recipe the base is built
first (its warm-start cached in ``WORK/base/warmstart``, evaluated greedily in bf16 on
the eval split) and every run starts from it (``model.path``; no warm-start of its own).

Runs live in ``WORK/runs/<name>/seed<k>``. A finished run is not run again, an
interrupted one is resumed, so a suite cut short continues where it stopped; a failed
run is recorded (its log's last lines) and the rest go on. ``collect`` copies each run's
``metrics.jsonl`` and ``config.yaml`` into the results directory, which
:mod:`quarl.experiments.results` summarises and renders.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from quarl.config.typed import merge, parse_overrides, read_yaml
from quarl.experiments.flagged import FLAGGED_FILE, copy_flagged
from quarl.experiments.spec import (  # noqa: F401 (the spec's names, for the CLI and the tests)
    AT, BASE_SECTIONS, SUITE_FILE, Column, Plot, Suite, check_seeds, load_suite,
)
from quarl.io import replace_dir


# ---------------------------------------------------------------------- configs


def run_config(suite: Suite, name: str, seed: int, run_dir: Path, base_model: Path | None,
               overrides: list[str] = ()) -> dict[str, Any]:
    """The whole config of one run of the suite (see the module's docstring for the order)."""
    cfg: dict[str, Any] = {}
    if suite.base is not None:
        recipe = read_yaml(suite.base)
        cfg = {k: v for k, v in recipe.items() if k in BASE_SECTIONS}
    cfg = merge(cfg, suite.common)
    cfg = merge(cfg, suite.runs[name])
    cfg = merge(cfg, parse_overrides(list(overrides)))
    pinned: dict[str, Any] = {"trainer": {"seed": seed, "run_dir": str(run_dir)}}
    if base_model is not None:
        pinned["model"] = {"path": str(base_model), "tokenizer": "builtin"}
        pinned["trainer"]["sft_warmup_steps"] = 0
    return merge(cfg, pinned)


# ---------------------------------------------------------------------- the base


def build_base(suite: Suite, work: Path, overrides: list[str] = (), log=print) -> tuple[Path, dict[str, Any]]:
    """Warm-start the suite's base model into ``work/base`` (cached), evaluate it greedily
    in bf16 on the eval split; returns its directory and ``base.json``'s contents."""
    import torch

    from quarl.config.run import RunConfig
    from quarl.config.typed import from_dict
    from quarl.trainer.evaluation import build_for_evaluation

    base_dir = work / "base"
    info_file = base_dir / "base.json"
    model_dir = base_dir / "warmstart"
    cfg = from_dict(RunConfig, merge(read_yaml(suite.base), base_overrides(overrides, base_dir)))
    if info_file.is_file() and model_dir.is_dir():
        info = json.loads(info_file.read_text())
        if info.get("recipe") == _recipe(cfg):
            log(f"base: {model_dir} (built earlier)")
            return model_dir, info
    shared = sibling_base(work, _recipe(cfg))
    if shared is not None:  # another suite beside this one built the same recipe: the same weights
        link_tree(shared, base_dir)
        log(f"base: {model_dir} (the same recipe as {shared}; linked, not trained again)")
        return model_dir, json.loads(info_file.read_text())
    if cfg.trainer.sft_warmup_steps == 0:
        raise ValueError(f"{suite.base}: the base recipe must warm-start (trainer.sft_warmup_steps > 0)")
    t0 = time.perf_counter()
    steps = cfg.trainer.sft_warmup_steps
    span = (f"up to {steps} steps (until held-out exact >= {cfg.trainer.sft_target_exact})"
            if cfg.trainer.sft_target_exact > 0 else f"{steps} steps")
    log(f"base: warm-starting {cfg.model.builtin or cfg.model.path} for {span}")
    run = build_for_evaluation(cfg, resume=False)  # the warm start, its engine, data and verifier
    try:
        built = time.perf_counter() - t0
        metrics, _ = run.evaluation.run(run.policy)
    finally:
        run.rewards.close()
        del run
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    warm = json.loads((model_dir / "warmstart.json").read_text())
    losses = warm.get("losses") or []
    info = {"recipe": _recipe(cfg), "eval": metrics, "warmstart_s": round(built, 1),
            "eval_s": round(time.perf_counter() - t0 - built, 1), "steps": len(losses),
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "loss_every_100": losses[::100], "heldout": warm.get("heldout") or [],
            "weights_sha256": weights_digest(model_dir)}
    info_file.write_text(json.dumps(info, indent=2))
    log(f"base: warm start {info['warmstart_s']} s, {len(losses)} steps, "
        f"loss {info['loss_first']:.3f} -> {info['loss_last']:.4f}, "
        f"eval/acc {metrics.get('eval/acc', float('nan')):.3f} (bf16, greedy)")
    target = cfg.trainer.sft_target_exact
    if target > 0 and info["heldout"] and info["heldout"][-1]["exact"] < target:
        log(f"base: warning: held-out exact {info['heldout'][-1]['exact']:.3f} after the cap of {len(losses)} steps, "
            f"short of the target {target}: raise trainer.sft_warmup_steps in {suite.base}")
    return model_dir, info


def sibling_base(work: Path, recipe: dict[str, Any]) -> Path | None:
    """A base built from ``recipe`` by another suite whose work directory is beside ``work``
    (``runs/suites/<suite>/base``), or None."""
    own = (work / "base").resolve()
    for info_file in sorted(work.parent.glob("*/base/base.json")):
        base_dir = info_file.parent
        if base_dir.resolve() == own or not (base_dir / "warmstart").is_dir():
            continue
        try:
            if json.loads(info_file.read_text()).get("recipe") == recipe:
                return base_dir
        except (OSError, ValueError):
            continue
    return None


def link_tree(src: Path, dst: Path) -> None:
    """``dst`` becomes a copy of ``src``, written beside it and renamed into place. Its weight
    files (``*.safetensors``) are hard links where the filesystem allows (a 100M base is
    ~0.6 GB): a rebuild of ``src`` writes a new directory and leaves them intact. The rest
    (``base.json``, which a rebuild rewrites in place) is copied."""
    def link(a: str, b: str) -> None:
        if a.endswith(".safetensors"):
            try:
                os.link(a, b)
                return
            except OSError:
                pass
        shutil.copy2(a, b)

    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=link)
    replace_dir(tmp, dst)


def base_overrides(overrides: list[str], base_dir: Path) -> dict[str, Any]:
    """What of the suite's command-line flags shapes the base: the model and data sections,
    the warm-start's own fields (``trainer.sft_*``) and the device; evaluated in bf16."""
    given = parse_overrides(list(overrides))
    keep = {k: v for k, v in given.items() if k in ("model", "data")}
    trainer = {k: v for k, v in (given.get("trainer") or {}).items() if k.startswith("sft_") or k == "device"}
    return merge(keep, {"trainer": {**trainer, "run_dir": str(base_dir), "tensorboard": False},
                        "quant": {"mode": "bf16"}})


def _recipe(cfg) -> dict[str, Any]:
    from dataclasses import asdict

    d = asdict(cfg)
    return {"model": d["model"], "data": d["data"], "rollout": d["rollout"],
            "sft": [d["trainer"]["sft_warmup_steps"], d["trainer"]["sft_lr"], d["trainer"]["seed"]]
            + ([d["trainer"]["sft_target_exact"]] if d["trainer"]["sft_target_exact"] > 0 else [])}


# ---------------------------------------------------------------------- running


@dataclass
class RunState:
    name: str
    seed: int
    run_dir: Path
    config_file: Path
    log_file: Path
    steps: int
    proc: subprocess.Popen | None = None
    started: float = 0.0
    started_wall: float = 0.0
    seconds: float = 0.0
    phases: dict[str, float] | None = None  # start-up, steps, the end (seconds; from the rows' wall times)
    status: str = "pending"  # pending | running | done | failed | skipped | interrupted
    tail: str = ""


def steps_done(run_dir: Path) -> int:
    """The last step a run's ``metrics.jsonl`` logged (0 for none)."""
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return 0
    last = 0
    for line in f.read_text().splitlines():
        try:
            last = max(last, int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError):
            continue
    return last


def plan_runs(suite: Suite, work: Path, base_model: Path | None, overrides: list[str] = (),
              only: list[str] | None = None) -> list[RunState]:
    """One :class:`RunState` per (run, seed), seeds outermost (every run's first seed comes
    first); each run's whole config written to ``work/configs``."""
    from quarl.config import load_run_config

    names = list(suite.runs)
    if only:
        missing = [n for n in only if n not in suite.runs]
        if missing:
            raise ValueError(f"--only: no run named {', '.join(missing)} in {suite.root}; runs: {', '.join(names)}")
        names = [n for n in names if n in only]
    (work / "configs").mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    plan = []
    for seed in suite.seeds:
        for name in names:
            run_dir = work / "runs" / name / f"seed{seed}"
            cfg = run_config(suite, name, seed, run_dir, base_model, overrides)
            config_file = work / "configs" / f"{name}-seed{seed}.yaml"
            config_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
            try:
                steps = load_run_config(str(config_file)).trainer.steps  # a bad run config fails before any run
            except ValueError as e:
                raise ValueError(f"run {name} of {suite.root}: {e}") from e
            plan.append(RunState(name, seed, run_dir, config_file, work / "logs" / f"{name}-seed{seed}.log", steps))
    return plan


def run_suite(suite: Suite, work: str | Path, overrides: list[str] = (), parallel: int | None = None,
              only: list[str] | None = None, keep_checkpoints: bool = False, log=print) -> list[RunState]:
    """Build the base (if any), then every (run, seed) of ``suite`` with ``parallel`` at once.
    A finished run's checkpoints are deleted unless ``keep_checkpoints`` (a 100M model's
    weights and optimizer take ~1.2 GB; a suite runs dozens)."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    base_model = base_digest = None
    if suite.base is not None:
        base_model, info = build_base(suite, work, overrides, log)
        base_digest = info.get("weights_sha256")
    plan = plan_runs(suite, work, base_model, overrides, only)
    _reuse_finished(plan, work, base_digest, log)
    width = parallel or suite.parallel
    env = run_env(width)
    queue = list(plan)
    running: list[RunState] = []
    total, finished = len(plan), 0
    t_suite = time.perf_counter()
    log(f"suite {suite.name}: {total} runs ({len(plan) // len(suite.seeds)} configs x {len(suite.seeds)} seeds), "
        f"{width} at once, in {work}")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # a SIGTERM (a timeout) stops it as Ctrl-C does
    try:
        while queue or running:
            while queue and len(running) < width:
                r = queue.pop(0)
                if steps_done(r.run_dir) >= r.steps:
                    r.status = "skipped"
                    finished += 1
                    log(f"[{finished}/{total}] {r.name} seed {r.seed}: finished earlier")
                    continue
                _start(r, env)
                running.append(r)
            time.sleep(0.2)
            for r in list(running):
                code = r.proc.poll()
                if code is None:
                    continue
                running.remove(r)
                finished += 1
                log(f"[{finished}/{total}] {_finish(r, code, keep_checkpoints)}")
    except KeyboardInterrupt:
        log(f"suite {suite.name}: interrupted; stopping {len(running)} run(s) after their current step")
        for r in running:
            r.proc.terminate()  # the trainer saves a checkpoint on SIGTERM; a rerun resumes it
        for r in running:
            r.proc.wait()
            r.status = "interrupted"
        _write_status(work, suite, plan)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    log(f"suite {suite.name}: {sum(r.status in ('done', 'skipped') for r in plan)} of {total} runs complete in "
        f"{time.perf_counter() - t_suite:.0f} s")
    _write_status(work, suite, plan)
    return plan


def _reuse_finished(plan: list[RunState], work: Path, base_digest: str | None, log=print) -> None:
    """Before a suite runs: a run trained from an earlier base (the recipe changed since) starts
    again; a run another suite beside this one has already finished, as this one would run it,
    is copied instead of run."""
    for r in plan:
        marker = r.config_file.with_suffix(".base")
        if r.run_dir.exists() and marker.is_file() and marker.read_text() != str(base_digest):
            log(f"{r.name} seed {r.seed}: trained from another base ({marker.read_text()}); starting it again")
            shutil.rmtree(r.run_dir)
        marker.write_text(str(base_digest))
    for r in plan:
        if not r.run_dir.exists() and (src := sibling_run(work, r, base_digest)) is not None:
            copy_run(src, r.run_dir, src.parents[2], work)
            log(f"{r.name} seed {r.seed}: the same run as {src} (the same config and base); copied, not run again")


def _start(r: RunState, env: dict[str, str]) -> None:
    """Launch ``r``'s training process (resuming from its checkpoint where it has one)."""
    resume = ["--resume"] if (r.run_dir / "checkpoints").is_dir() else []
    if not resume and r.run_dir.exists():
        shutil.rmtree(r.run_dir)  # started, but cut before its first checkpoint
    cmd = [sys.executable, "-m", "quarl", "train", "--config", str(r.config_file), "--quiet", *resume]
    r.started, r.started_wall = time.perf_counter(), time.time()
    r.status = "running"
    with open(r.log_file, "ab") as f:
        # its own session: a Ctrl-C here reaches the suite alone, which passes one SIGTERM on
        r.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _finish(r: RunState, code: int, keep_checkpoints: bool) -> str:
    """Record the end of ``r``'s process (exit ``code``); the log line saying how it went."""
    r.seconds = time.perf_counter() - r.started
    r.phases = run_phases(r.run_dir / "metrics.jsonl", r.started_wall, time.time())
    r.status = "done" if code == 0 else "failed"
    if code == 0 and not keep_checkpoints:
        shutil.rmtree(r.run_dir / "checkpoints", ignore_errors=True)
    if code != 0:
        r.tail = "\n".join(r.log_file.read_text(errors="replace").splitlines()[-15:])
    phases = (f" [start {r.phases['start']:.0f} s, steps {r.phases['steps']:.0f} s, "
              f"end {r.phases['end']:.0f} s]") if r.phases else ""
    return (f"{r.name} seed {r.seed}: {r.status} in {r.seconds:.0f} s{phases}"
            + (f" (exit {code}; log {r.log_file})" if code else _headline(r.run_dir)))


def sibling_run(work: Path, r: RunState, base_digest: str | None) -> Path | None:
    """The finished run directory of another suite beside ``work`` (``<parent>/<suite>/runs/
    <name>/seed<k>``) whose run config is ``r``'s but for the work directory in its paths, and
    which trained from the same base; or None."""
    own = work.resolve()
    mine = yaml.safe_load(r.config_file.read_text())
    for other in sorted(p for p in work.parent.iterdir() if p.is_dir() and p.resolve() != own):
        config_file = other / "configs" / r.config_file.name
        marker = config_file.with_suffix(".base")
        src = other / "runs" / r.name / f"seed{r.seed}"
        if not (config_file.is_file() and marker.is_file()) or marker.read_text() != str(base_digest):
            continue
        try:
            theirs = yaml.safe_load(config_file.read_text().replace(str(other), str(work)))
        except (OSError, yaml.YAMLError):
            continue
        if theirs == mine and steps_done(src) >= r.steps:
            return src
    return None


def copy_run(src: Path, dst: Path, src_work: Path, dst_work: Path) -> None:
    """``dst`` becomes a copy of the finished run ``src`` (written beside it, renamed into
    place), its ``config.yaml`` naming ``dst_work``'s paths where it named ``src_work``'s."""
    link_tree(src, dst)
    config = dst / "config.yaml"
    if config.is_file():
        config.write_text(config.read_text().replace(str(src_work), str(dst_work)))


def run_env(width: int, environ: dict[str, str] | None = None, cpus: int | None = None) -> dict[str, str]:
    """The environment of a suite's ``quarl train`` processes: ``width`` of them at once share
    the host's cores, so each one's CPU thread pools (torch's, OpenMP's) get an equal share,
    as torchrun does, unless the caller set ``OMP_NUM_THREADS`` itself."""
    env = dict(os.environ if environ is None else environ, PYTHONUNBUFFERED="1")
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // max(1, width))))
    return env


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _write_status(work: Path, suite: Suite, plan: list[RunState]) -> None:
    (work / f"runs-{suite.name}.json").write_text(json.dumps(
        [{"name": r.name, "seed": r.seed, "status": r.status, "seconds": round(r.seconds, 1), "phases": r.phases,
          "tail": r.tail} for r in plan], indent=2))


def run_phases(metrics_file: Path, started: float, ended: float) -> dict[str, float] | None:
    """Where a run's wall time went, from its rows' ``wall`` times: ``start`` (launch to the
    first row: imports, the engine's start, the step-0 evaluation if any, the first step),
    ``steps`` (first row to last) and ``end`` (the last row to the process's exit: the final
    checkpoint and report). None without timed rows; a resumed run's earlier rows are left out."""
    walls = []
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            try:
                w = json.loads(line).get("wall")
            except (ValueError, AttributeError):
                continue
            if isinstance(w, (int, float)) and w >= started:
                walls.append(float(w))
    if not walls:
        return None
    return {"start": round(walls[0] - started, 1), "steps": round(walls[-1] - walls[0], 1),
            "end": round(ended - walls[-1], 1)}


def _headline(run_dir: Path) -> str:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return ""
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    acc = next((r["eval/acc"] for r in reversed(rows) if r.get("eval/acc") is not None), None)
    return f" (eval/acc {acc:.3f})" if acc is not None else ""


def collect(suite: Suite, work: str | Path, out: str | Path) -> Path:
    """Copy every run's ``metrics.jsonl`` and ``config.yaml`` (and some of its flagged
    responses: :mod:`quarl.experiments.flagged`; the base's ``base.json`` and the runs'
    status) into ``out``; returns ``out``."""
    from quarl.bench.common import git_commit

    work, out = Path(work), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    before = json.loads((out / "meta.json").read_text()) if (out / "meta.json").is_file() else None
    if before is not None and before.get("suite") != suite.name:
        raise ValueError(f"{out} holds the results of suite {before.get('suite')!r}, not {suite.name!r}: "
                         "choose another --out")
    copied = []
    for name in suite.runs:
        for seed in suite.seeds:
            src = work / "runs" / name / f"seed{seed}"
            if not (src / "metrics.jsonl").is_file():
                continue
            dst = out / "runs" / name / f"seed{seed}"
            dst.mkdir(parents=True, exist_ok=True)
            for f in ("metrics.jsonl", "config.yaml"):
                if (src / f).is_file():
                    shutil.copyfile(src / f, dst / f)
            copy_flagged(src / "samples.jsonl", dst / FLAGGED_FILE)  # the error-token detector's hits
            copied.append(f"{name} seed {seed}")
    base = json.loads((work / "base/base.json").read_text()) if (work / "base/base.json").is_file() else None
    if base is not None:
        (out / "base.json").write_text(json.dumps(base, indent=2))
    status_file = work / f"runs-{suite.name}.json"
    if status_file.is_file():  # merged with an earlier call's: this call's entries win
        old = json.loads((out / "runs.json").read_text()) if (out / "runs.json").is_file() else []
        new = json.loads(status_file.read_text())
        fresh = {(r["name"], r["seed"]) for r in new}
        (out / "runs.json").write_text(json.dumps([r for r in old if (r["name"], r["seed"]) not in fresh] + new,
                                                  indent=2))
    shutil.copyfile(suite.root / SUITE_FILE, out / SUITE_FILE)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    call = {"date": date, "git_commit": git_commit(), "device": _device_name(), "seeds": suite.seeds,
            "runs": copied, "base_sha256": (base or {}).get("weights_sha256"),
            "base_eval_acc": ((base or {}).get("eval") or {}).get("eval/acc")}
    seeds = list((before or {}).get("seeds") or [])
    seeds += [k for k in suite.seeds if k not in seeds]
    names = list((before or {}).get("runs") or [])
    names += [n for n in suite.runs if n not in names]
    meta = {"suite": suite.name, "git_commit": call["git_commit"], "date": date, "device": call["device"],
            "seeds": seeds, "runs": names, "calls": [*(before or {}).get("calls", []), call]}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return out


def weights_digest(model_dir: Path) -> str:
    """The first 16 hex digits of the sha256 of a saved model's safetensors files (in name
    order): the same digest, the same base weights, also across machines."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def _device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:
        return "unknown"
