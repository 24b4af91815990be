"""Experiment suites: loading suite.yaml, each run's config, the plan, and one tiny suite end to end."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from quarl.cli.main import main
from quarl.config import load_run_config
from quarl.experiments.suite import Column, Plot, base_overrides, load_suite, plan_runs, run_config, run_env

BF16 = {"quant": {"mode": "bf16"}}
W4 = {"quant": {"mode": "rollout", "scheme": "w4a16"}}


def _write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _suite(tmp_path: Path, spec: dict, runs: dict | None = None, name: str = "s") -> Path:
    """A suite directory ``tmp_path/name`` with suite.yaml ``spec`` and run files ``runs``."""
    root = tmp_path / name
    root.mkdir(parents=True, exist_ok=True)
    _write(root / "suite.yaml", spec)
    for run, cfg in (runs if runs is not None else {"bf16": BF16, "w4": W4}).items():
        _write(root / f"{run}.yaml", cfg)
    return root


# ---------------------------------------------------------------------- load_suite


def test_load_suite_reads_every_field(tmp_path):
    _write(tmp_path / "base.yaml", {"model": {"builtin": "tiny"}})
    root = _suite(tmp_path, {
        "title": "T", "about": "  why  \n", "base": "../base.yaml", "seeds": [3, 1], "parallel": 2,
        "common": {"trainer": {"steps": 2}}, "baseline": "bf16",
        "table": ["eval/acc", {"metric": "time/step", "at": "tail", "tail": 2, "ratio": True, "label": "speed"}],
        "plots": [{"title": "P", "metrics": ["a", "b"]}, {"metrics": ["c"], "kind": "bars", "at": "max", "log": True}],
    })
    s = load_suite(root)
    assert (s.name, s.title, s.about, s.seeds, s.parallel, s.baseline) == ("s", "T", "why", [3, 1], 2, "bf16")
    assert s.base == (tmp_path / "base.yaml").resolve()
    assert s.common == {"trainer": {"steps": 2}}
    assert s.table == [Column("eval/acc"), Column("time/step", "tail", True, 2, "speed")]
    assert s.plots == [Plot("P", ("a", "b")), Plot("c", ("c",), "bars", "max", True)]
    assert s.runs == {"bf16": BF16, "w4": W4}  # every *.yaml beside suite.yaml, by its stem, sorted


def test_load_suite_defaults(tmp_path):
    s = load_suite(_suite(tmp_path, {}))
    assert (s.title, s.about, s.base, s.seeds, s.parallel, s.common, s.baseline, s.table, s.plots) == (
        "s", "", None, [0], 1, {}, None, [], [])


@pytest.mark.parametrize("spec, message", [
    ({"seed": [0]}, "unknown key(s) seed"),
    ({"seeds": []}, "seeds must be a non-empty list of distinct integers, got []"),
    ({"seeds": [0, 0]}, "seeds must be a non-empty list of distinct integers, got [0, 0]"),
    ({"seeds": 3}, "seeds must be a non-empty list"),
    ({"seeds": [0, "1"]}, "seeds must be a non-empty list"),
    ({"parallel": 0}, "parallel must be an integer >= 1, got 0"),
    ({"baseline": "fp8"}, "baseline 'fp8' is not one of the runs (bf16, w4)"),
    ({"table": [{"metric": "t", "ratio": True}]}, "a ratio column needs a baseline run"),
    ({"table": [{"metric": "t", "at": "p90"}]}, "table column t: at must be one of last, first, mean, max, min, "
                                                "tail, median, got 'p90'"),
    ({"table": [{"metric": "t", "at": "tail", "tail": 0}]}, "table column t: tail must be an integer >= 1"),
    ({"table": [{"metric": "t", "how": "last"}]}, "table column t: unknown key(s) how"),
    ({"table": [{"at": "last"}]}, "a table column is a metric name or a mapping with 'metric'"),
    ({"table": [{"metric": "t", "without": ["perf/compiles"]}]}, "table column t: without names a metric"),
    ({"plots": [{"title": "P", "kind": "bars", "metrics": ["a"], "without": 0}]},
     "plot 'P': without names a metric, got 0"),
    ({"plots": [{"title": "P", "metrics": ["a"], "without": "perf/compiles"}]}, "plot 'P': without leaves steps out "
                                                                                  "of a bars plot's reduction"),
    ({"plots": [{"title": "P", "metrics": ["a"], "kind": "pie"}]}, "plot 'P': kind must be lines or bars, got 'pie'"),
    ({"plots": [{"title": "P", "metrics": ["a"], "at": "p90"}]}, "plot 'P': at must be one of"),
    ({"plots": [{"title": "P", "metrics": []}]}, "a non-empty list of metrics"),
    ({"plots": [{"title": "P", "metrics": ["a"], "colour": "red"}]}, "plot 'P': unknown key(s) colour"),
    ({"base": "../nope.yaml"}, "base recipe ../nope.yaml does not exist"),
    ({"common": "nope.yaml"}, "common: nope.yaml does not exist"),
    ({"common": [{"trainer": {"steps": 1}}, "../nope.yaml"]}, "common: ../nope.yaml does not exist"),
    ({"common": [3]}, "common must be a mapping of config sections, a YAML file or a list of these, got 3"),
])
def test_load_suite_errors_name_the_problem_and_the_file(tmp_path, spec, message):
    root = _suite(tmp_path, spec)
    with pytest.raises(ValueError) as e:
        load_suite(root)
    assert message in str(e.value)
    assert str(root / "suite.yaml") in str(e.value)


def test_load_suite_without_suite_yaml_or_runs(tmp_path):
    with pytest.raises(ValueError, match="is not a suite: it has no suite.yaml"):
        load_suite(tmp_path)
    root = _suite(tmp_path, {"seeds": [0]}, runs={})
    with pytest.raises(ValueError, match=r"at least one run config \(\*\.yaml\)"):
        load_suite(root)


def test_load_suite_of_a_results_directory_takes_the_run_names(tmp_path):
    """A results directory's copy of suite.yaml: the base and common files need not exist."""
    root = _suite(tmp_path, {"base": "../gone.yaml", "common": ["../gone-too.yaml", {"trainer": {"steps": 3}}],
                             "baseline": "x"}, runs={})
    s = load_suite(root, ["x", "y"])
    assert s.runs == {"x": {}, "y": {}} and s.common == {"trainer": {"steps": 3}}


def test_common_files_and_mappings_merge_in_order(tmp_path):
    _write(tmp_path / "rl.yaml", {"trainer": {"steps": 10, "prompts_per_step": 4}, "algo": {"loss": "ppo"}})
    later = load_suite(_suite(tmp_path, {"common": ["../rl.yaml", {"trainer": {"steps": 40}}]}, name="a"))
    assert later.common == {"trainer": {"steps": 40, "prompts_per_step": 4}, "algo": {"loss": "ppo"}}
    earlier = load_suite(_suite(tmp_path, {"common": [{"trainer": {"steps": 40, "eval_every": 5}}, "../rl.yaml"]},
                                name="b"))
    assert earlier.common == {"trainer": {"steps": 10, "eval_every": 5, "prompts_per_step": 4}, "algo": {"loss": "ppo"}}
    alone = load_suite(_suite(tmp_path, {"common": "../rl.yaml"}, name="c"))
    assert alone.common == {"trainer": {"steps": 10, "prompts_per_step": 4}, "algo": {"loss": "ppo"}}


# ---------------------------------------------------------------------- run configs


@pytest.fixture
def layered(tmp_path):
    """A suite whose base recipe, common and run file all set some of the same keys."""
    _write(tmp_path / "base.yaml", {
        "model": {"builtin": "tiny", "dtype": "float32"}, "data": {"num_eval": 8, "difficulty": 2},
        "rollout": {"n": 2, "max_new_tokens": 8}, "quant": {"mode": "aligned"},
        "trainer": {"sft_warmup_steps": 5, "steps": 99, "eval_every": 3},  # not taken by the runs
    })
    root = _suite(tmp_path, {
        "base": "../base.yaml", "seeds": [3],
        "common": {"data": {"num_eval": 16}, "rollout": {"n": 3}, "trainer": {"steps": 2, "prompts_per_step": 4}},
    }, runs={"r": {"rollout": {"n": 4}, "trainer": {"steps": 3, "seed": 42, "sft_warmup_steps": 10}}})
    return load_suite(root)


def test_run_config_precedence_without_a_base_model(layered, tmp_path):
    cfg = run_config(layered, "r", 3, tmp_path / "run", None, ["--trainer.steps=7", "--model.dtype=bfloat16"])
    assert cfg == {
        "model": {"builtin": "tiny", "dtype": "bfloat16"},             # flag > base recipe
        "data": {"num_eval": 16, "difficulty": 2},                     # common > base recipe
        "rollout": {"n": 4, "max_new_tokens": 8},                      # run file > common > base recipe
        "trainer": {"steps": "7", "prompts_per_step": 4, "seed": 3,    # flag > run file > common; seed pinned
                    "sft_warmup_steps": 10, "run_dir": str(tmp_path / "run")},
    }  # the recipe's quant and trainer sections are not taken


def test_run_config_with_a_base_model_pins_it(layered, tmp_path):
    cfg = run_config(layered, "r", 3, tmp_path / "run", tmp_path / "base/warmstart")
    assert cfg["model"] == {"builtin": "tiny", "dtype": "float32", "path": str(tmp_path / "base/warmstart"),
                            "tokenizer": "builtin"}
    assert cfg["trainer"] == {"steps": 3, "prompts_per_step": 4, "seed": 3, "sft_warmup_steps": 0,
                              "run_dir": str(tmp_path / "run")}
    # even a flag does not undo the pins
    pinned = run_config(layered, "r", 3, tmp_path / "run", tmp_path / "b", ["--trainer.seed=9",
                                                                           "--trainer.sft_warmup_steps=4"])
    assert (pinned["trainer"]["seed"], pinned["trainer"]["sft_warmup_steps"]) == (3, 0)


def test_run_config_without_a_base_recipe(tmp_path):
    s = load_suite(_suite(tmp_path, {"common": {"trainer": {"steps": 2}}}, runs={"r": {"trainer": {"steps": 5}}}))
    assert run_config(s, "r", 0, tmp_path / "d", None) == {"trainer": {"steps": 5, "seed": 0,
                                                                       "run_dir": str(tmp_path / "d")}}


def test_base_overrides_keep_what_shapes_the_base(tmp_path):
    got = base_overrides(["--model.builtin=small", "--data.num_eval=16", "--trainer.sft_warmup_steps=9",
                          "--trainer.sft_lr=1e-3", "--trainer.device=cpu", "--trainer.steps=5", "--trainer.seed=4",
                          "--quant.mode=aligned", "--rollout.n=8", "--algo.loss=ppo"], tmp_path / "base")
    assert got == {
        "model": {"builtin": "small"}, "data": {"num_eval": "16"},
        "trainer": {"sft_warmup_steps": "9", "sft_lr": "1e-3", "device": "cpu", "run_dir": str(tmp_path / "base"),
                    "tensorboard": False},
        "quant": {"mode": "bf16"},
    }
    assert base_overrides([], tmp_path / "b") == {"trainer": {"run_dir": str(tmp_path / "b"), "tensorboard": False},
                                                  "quant": {"mode": "bf16"}}


# ---------------------------------------------------------------------- the plan


def _plannable(tmp_path, runs=None):
    return load_suite(_suite(tmp_path, {"seeds": [3, 1], "common": {"model": {"builtin": "tiny"},
                                                                   "trainer": {"steps": 2}}},
                             runs=runs or {"bf16": BF16, "w4": {**W4, "trainer": {"steps": 6}}}))


def test_plan_runs_seeds_outermost_and_one_config_each(tmp_path):
    suite, work = _plannable(tmp_path), tmp_path / "work"
    plan = plan_runs(suite, work, None, ["--rollout.n=3"])
    assert [(r.name, r.seed) for r in plan] == [("bf16", 3), ("w4", 3), ("bf16", 1), ("w4", 1)]
    assert sorted(p.name for p in (work / "configs").iterdir()) == [
        "bf16-seed1.yaml", "bf16-seed3.yaml", "w4-seed1.yaml", "w4-seed3.yaml"]
    for r in plan:
        assert r.run_dir == work / "runs" / r.name / f"seed{r.seed}"
        assert r.config_file == work / "configs" / f"{r.name}-seed{r.seed}.yaml"
        assert r.log_file == work / "logs" / f"{r.name}-seed{r.seed}.log" and r.log_file.parent.is_dir()
        assert r.status == "pending"
        written = yaml.safe_load(r.config_file.read_text())
        assert written == run_config(suite, r.name, r.seed, r.run_dir, None, ["--rollout.n=3"])
        cfg = load_run_config(str(r.config_file))
        assert (cfg.trainer.seed, cfg.trainer.run_dir, cfg.rollout.n) == (r.seed, str(r.run_dir), 3)
        assert r.steps == cfg.trainer.steps == (6 if r.name == "w4" else 2)


def test_plan_runs_only(tmp_path):
    suite, work = _plannable(tmp_path), tmp_path / "work"
    assert [(r.name, r.seed) for r in plan_runs(suite, work, None, only=["w4"])] == [("w4", 3), ("w4", 1)]
    with pytest.raises(ValueError, match="--only: no run named fp8.*runs: bf16, w4"):
        plan_runs(suite, work, None, only=["w4", "fp8"])


def test_plan_runs_rejects_a_bad_run_config_naming_the_run(tmp_path):
    suite = _plannable(tmp_path, runs={"bf16": BF16, "broken": {"algo": {"loss": "nonsense"}}})
    with pytest.raises(ValueError, match=r"run broken of .*algo\.loss: 'nonsense' is not one of"):
        plan_runs(suite, tmp_path / "work", None)
    with pytest.raises(ValueError, match=r"run bf16 of .*unknown config key 'trainer\.stepz'"):
        plan_runs(_plannable(tmp_path / "2"), tmp_path / "work2", None, ["--trainer.stepz=3"])


# ---------------------------------------------------------------------- end to end


def test_run_env_shares_the_cores_among_the_runs_at_once():
    env = run_env(7, {"PATH": "/bin"}, cpus=16)
    assert env["OMP_NUM_THREADS"] == "2" and env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == "/bin"
    assert run_env(32, {}, cpus=16)["OMP_NUM_THREADS"] == "1"  # never below one thread
    assert run_env(1, {}, cpus=16)["OMP_NUM_THREADS"] == "16"
    assert run_env(7, {"OMP_NUM_THREADS": "5"}, cpus=16)["OMP_NUM_THREADS"] == "5"  # the caller's setting stands


def _main(*argv) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(list(argv))
    return code, buf.getvalue()


def _tiny_suite(root: Path) -> Path:
    _write(root / "base.yaml", {"model": {"builtin": "tiny"}, "data": {"task": "arith", "num_eval": 8},
                                "rollout": {"n": 2, "max_new_tokens": 8}, "trainer": {"sft_warmup_steps": 5}})
    return _suite(root, {
        "title": "Tiny suite", "about": "Does a w4a16 rollout drift from bf16?", "base": "../base.yaml",
        "seeds": [0, 1], "parallel": 2,
        "common": {"trainer": {"steps": 2, "prompts_per_step": 2, "eval_every": 1, "eval_before_train": True,
                               "tensorboard": False, "save_every": 0}},
        "baseline": "bf16",
        "table": [{"metric": "eval/acc", "at": "first"}, {"metric": "mismatch/kl_k3", "at": "mean"},
                  {"metric": "time/step", "at": "mean", "ratio": True}],
        "plots": [{"title": "Accuracy and KL", "metrics": ["eval/acc", "mismatch/kl_k3"]},
                  {"title": "Step time", "metrics": ["time/step"], "kind": "bars"}],
    }, runs={"bf16": BF16, "rollout-w4a16": W4}, name="tiny")


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory):
    """The tiny suite run once through ``quarl suite run`` (a base, 2 runs x 2 seeds, 2 at once)."""
    root = tmp_path_factory.mktemp("suite")
    suite_dir = _tiny_suite(root)
    work, out = root / "work", root / "out"
    code, stdout = _main("suite", "run", str(suite_dir), "--work", str(work), "--out", str(out))
    logs = {f.name: f.read_text()[-3000:] for f in (work / "logs").glob("*.log")} if (work / "logs").is_dir() else {}
    return SimpleNamespace(dir=suite_dir, work=work, out=out, code=code, stdout=stdout, logs=logs)


RUNS = [(name, seed) for name in ("bf16", "rollout-w4a16") for seed in (0, 1)]


def _rows(f: Path) -> list[dict]:
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def test_suite_run_end_to_end(tiny_suite):
    t = tiny_suite
    assert t.code == 0, (t.stdout, t.logs)
    assert "4 of 4 runs complete" in t.stdout
    base = json.loads((t.out / "base.json").read_text())
    assert "eval/acc" in base["eval"] and base["steps"] == 5
    for name, seed in RUNS:
        copied = t.out / "runs" / name / f"seed{seed}"
        rows = _rows(copied / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert "eval/acc" in rows[0] and "reward/mean" not in rows[0]  # the step-0 policy, evaluated first
        assert (copied / "metrics.jsonl").read_text() == (t.work / "runs" / name / f"seed{seed}" /
                                                          "metrics.jsonl").read_text()
        cfg = yaml.safe_load((copied / "config.yaml").read_text())
        assert cfg["trainer"]["seed"] == seed and cfg["trainer"]["sft_warmup_steps"] == 0
        assert cfg["model"]["path"] == str(t.work / "base" / "warmstart")  # every run starts from the base
        assert cfg["quant"]["mode"] == ("bf16" if name == "bf16" else "rollout")
        run_dir = t.work / "runs" / name / f"seed{seed}"
        assert not (run_dir / "checkpoints").exists()  # deleted once finished
        assert not (run_dir / "warmstart").exists()  # no warm start of its own
    status = json.loads((t.out / "runs.json").read_text())
    assert sorted((r["name"], r["seed"], r["status"]) for r in status) == sorted((n, s, "done") for n, s in RUNS)
    for r in status:  # each run's wall time split at its first and last logged rows
        p = r["phases"]
        assert p["start"] > 0 and p["steps"] > 0 and p["end"] >= 0
        assert p["start"] + p["steps"] + p["end"] <= r["seconds"] + 1.0
    assert "| run | start | steps | end | seeds |" in (t.out / "README.md").read_text()

    summary = json.loads((t.out / "summary.json").read_text())
    assert summary["missing"] == [] and summary["failed"] == [] and summary["seeds"] == [0, 1]
    ratio = "time/step (mean / baseline)"
    assert summary["runs"]["bf16"][ratio]["seeds"] == {"0": 1.0, "1": 1.0}
    assert summary["runs"]["rollout-w4a16"][ratio]["n"] == 2
    kl = "mismatch/kl_k3 (mean)"
    assert summary["runs"]["rollout-w4a16"][kl]["mean"] > summary["runs"]["bf16"][kl]["mean"]
    first = "eval/acc (first)"
    for name, seed in RUNS:  # the first value is the step-0 row's
        step0 = _rows(t.out / "runs" / name / f"seed{seed}" / "metrics.jsonl")[0]["eval/acc"]
        assert summary["runs"][name][first]["seeds"][str(seed)] == step0

    page = (t.out / "README.md").read_text()
    assert page.startswith("# Tiny suite\n\nDoes a w4a16 rollout drift from bf16?")
    assert "| run | eval/acc (first) | mismatch/kl_k3 (mean) | time/step (mean / baseline) |" in page
    assert "| bf16 | " in page and "| rollout-w4a16 | " in page
    for png, title in (("accuracy-and-kl.png", "Accuracy and KL"), ("step-time.png", "Step time")):
        assert f"![{title}]({png})" in page
        assert (t.out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((t.out / "meta.json").read_text())["runs"] == ["bf16", "rollout-w4a16"]


def test_suite_run_again_skips_finished_runs(tiny_suite):
    t = tiny_suite
    assert t.code == 0, (t.stdout, t.logs)
    files = [t.work / "runs" / n / f"seed{s}" / "metrics.jsonl" for n, s in RUNS]
    before = [(f.read_text(), f.stat().st_mtime_ns) for f in files]
    code, stdout = _main("suite", "run", str(t.dir), "--work", str(t.work), "--out", str(t.out))
    assert code == 0, stdout
    assert "(built earlier)" in stdout
    assert stdout.count("finished earlier") == 4
    assert [(f.read_text(), f.stat().st_mtime_ns) for f in files] == before
    status = json.loads((t.out / "runs.json").read_text())
    assert {r["status"] for r in status} == {"skipped"}


def test_suite_report_renders_again(tiny_suite):
    t = tiny_suite
    assert t.code == 0, (t.stdout, t.logs)
    page = t.out / "README.md"
    table = [line for line in page.read_text().splitlines() if line.startswith("|")]
    for f in ("README.md", "summary.json", "accuracy-and-kl.png", "step-time.png"):
        (t.out / f).unlink()
    code, stdout = _main("suite", "report", str(t.out))
    assert code == 0 and stdout.strip() == str(page)
    assert [line for line in page.read_text().splitlines() if line.startswith("|")] == table
    assert (t.out / "summary.json").is_file()
    assert (t.out / "accuracy-and-kl.png").is_file() and (t.out / "step-time.png").is_file()


def test_suite_base_prints_its_evaluation(tiny_suite, tmp_path):
    t = tiny_suite
    work = tmp_path / "work"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code, stdout = _main("suite", "base", str(t.dir), "--work", str(work))
    assert code == 0, stdout
    assert "base: warm-starting tiny for 5 steps" in err.getvalue()  # a fresh work directory: built, not cached
    info = json.loads(stdout)  # stdout is the JSON alone (the log goes to stderr)
    assert [h["step"] for h in info["heldout"]] == [5] and 0 <= info["heldout"][0]["exact"] <= 1
    assert "eval/acc" in info["eval"] and info["steps"] == 5 and "recipe" not in info
    assert json.loads((work / "base" / "base.json").read_text())["eval"] == info["eval"]
    assert (work / "base" / "warmstart").is_dir()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code, again = _main("suite", "base", str(t.dir), "--work", str(work))  # cached
    assert code == 0 and "(built earlier)" in err.getvalue()
    assert json.loads(again) == info


def test_a_base_with_a_target_exact_share_checks_every_10_steps_up_to_its_cap(tmp_path):
    """trainer.sft_target_exact: the base is a different recipe (built again, its own digest),
    held-out checks every 10 steps; short of the target, it ends at the cap and says so."""
    from quarl.experiments.suite import build_base

    root = tmp_path / "t"
    suite_dir = _tiny_suite(root)
    plain = load_suite(suite_dir)
    logs: list[str] = []
    _, info = build_base(plain, root / "w0", log=logs.append)
    recipe = yaml.safe_load((root / "base.yaml").read_text())
    recipe["trainer"].update(sft_warmup_steps=25, sft_target_exact=0.9)  # a tiny model never gets there
    _write(root / "base.yaml", recipe)
    model_dir, target = build_base(load_suite(suite_dir), root / "w1", log=logs.append)
    assert "for up to 25 steps (until held-out exact >= 0.9)" in logs[-3]
    assert [h["step"] for h in target["heldout"]] == [10, 20, 25] and target["steps"] == 25
    assert target["recipe"]["sft"][-1] == 0.9 and info["recipe"]["sft"] == [5, 3e-3, 0]
    warm = json.loads((model_dir / "warmstart.json").read_text())
    assert warm["key"]["target_exact"] == 0.9 and warm["key"]["schedule"] == "constant"
    assert logs[-1].startswith("base: warning: held-out exact 0.000 after the cap of 25 steps, short of the target 0.9")


def test_suite_cli_errors_are_one_line(tmp_path, capsys):
    root = _suite(tmp_path, {"seeds": [0, 0]})
    assert main(["suite", "run", str(root), "--work", str(tmp_path / "w")]) == 2
    assert "quarl suite: error:" in capsys.readouterr().err
    assert main(["suite", "base", str(_suite(tmp_path, {}, name="nobase"))]) == 2
    assert "names no base recipe" in capsys.readouterr().err


def _one_run_suite(root: Path, name: str) -> Path:
    """A suite of one bf16 run on the tiny suite's base recipe (``root/base.yaml``)."""
    return _suite(root, {"title": name, "base": "../base.yaml", "seeds": [0], "parallel": 1,
                         "common": {"trainer": {"steps": 1, "prompts_per_step": 2, "eval_every": 0,
                                                "tensorboard": False, "save_every": 0}}},
                  runs={"bf16": BF16}, name=name)


def test_several_suites_run_in_turn_on_one_base(tmp_path):
    """`quarl suite run A B`: WORK/<suite> and OUT/<suite> each; B finds A's base (the same
    recipe, beside its own work directory) and links it instead of training it again."""
    _tiny_suite(tmp_path)  # writes tmp_path/base.yaml
    a, b = _one_run_suite(tmp_path, "first"), _one_run_suite(tmp_path, "second")
    work, out = tmp_path / "work", tmp_path / "out"
    code, stdout = _main("suite", "run", str(a), str(b), "--work", str(work), "--out", str(out))
    assert code == 0, stdout
    assert stdout.count("base: warm-starting tiny") == 1 and "linked, not trained again" in stdout
    for name in ("first", "second"):
        assert (out / name / "runs" / "bf16" / "seed0" / "metrics.jsonl").is_file()
        assert json.loads((out / name / "meta.json").read_text())["suite"] == name
    weights = sorted((work / "first" / "base" / "warmstart").glob("*.safetensors"))
    assert weights
    for f in weights:  # the same bytes, as hard links
        twin = work / "second" / "base" / "warmstart" / f.name
        assert twin.stat().st_ino == f.stat().st_ino
    first_info = json.loads((work / "first" / "base" / "base.json").read_text())
    assert json.loads((work / "second" / "base" / "base.json").read_text()) == first_info
    assert not (work / "second" / "base" / "base.json").samefile(work / "first" / "base" / "base.json")
    # B's bf16 run is A's (the same config but for the work directory, the same base): copied
    assert "bf16 seed 0: the same run as" in stdout and "copied, not run again" in stdout
    assert not (work / "second" / "logs" / "bf16-seed0.log").exists()  # never launched
    assert ((out / "second" / "runs" / "bf16" / "seed0" / "metrics.jsonl").read_bytes()
            == (out / "first" / "runs" / "bf16" / "seed0" / "metrics.jsonl").read_bytes())
    cfg = yaml.safe_load((out / "second" / "runs" / "bf16" / "seed0" / "config.yaml").read_text())
    assert cfg["model"]["path"] == str(work / "second" / "base" / "warmstart")
    assert cfg["trainer"]["run_dir"] == str(work / "second" / "runs" / "bf16" / "seed0")


def test_a_sibling_run_of_another_config_or_base_is_run_again(tmp_path):
    """A sibling suite's finished run is taken only for the same config and the same base."""
    _tiny_suite(tmp_path)
    a = _one_run_suite(tmp_path, "first")
    work = tmp_path / "work"
    assert _main("suite", "run", str(a), "--work", str(work / "first"), "--out", str(tmp_path / "o1"))[0] == 0
    b = _one_run_suite(tmp_path, "second")
    spec = yaml.safe_load((b / "suite.yaml").read_text())
    spec["common"]["trainer"]["prompts_per_step"] = 3  # another config
    _write(b / "suite.yaml", spec)
    code, stdout = _main("suite", "run", str(b), "--work", str(work / "second"), "--out", str(tmp_path / "o2"))
    assert code == 0 and "copied" not in stdout and (work / "second" / "logs" / "bf16-seed0.log").is_file()
    c = _one_run_suite(tmp_path, "third")  # A's config, but its marker names another base
    (work / "first" / "configs" / "bf16-seed0.base").write_text("0123456789abcdef")
    code, stdout = _main("suite", "run", str(c), "--work", str(work / "third"), "--out", str(tmp_path / "o3"))
    assert code == 0 and "copied" not in stdout and (work / "third" / "logs" / "bf16-seed0.log").is_file()


def test_a_sibling_base_of_another_recipe_is_not_taken(tmp_path):
    _tiny_suite(tmp_path)
    a, b = _one_run_suite(tmp_path, "first"), _one_run_suite(tmp_path, "second")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _main("suite", "base", str(a), "--work", str(tmp_path / "w" / "first"))[0] == 0
        code, _ = _main("suite", "base", str(b), "--work", str(tmp_path / "w" / "second"),
                        "--trainer.sft_warmup_steps=6")
    assert code == 0
    assert err.getvalue().count("base: warm-starting tiny") == 2 and "linked" not in err.getvalue()


def test_several_suites_refuse_only_and_twin_names(tmp_path, capsys):
    _tiny_suite(tmp_path)
    a, b = _one_run_suite(tmp_path, "first"), _one_run_suite(tmp_path, "second")
    assert main(["suite", "run", str(a), str(b), "--only", "bf16", "--work", str(tmp_path / "w")]) == 2
    assert "--only names the runs of one suite" in capsys.readouterr().err
    assert main(["suite", "run", str(a), str(a), "--work", str(tmp_path / "w")]) == 2
    assert "two suites are named 'first'" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before anything ran


def _fake_call(work: Path, suite_name: str, seeds: list[int], sha: str, acc: float) -> None:
    """A work directory as one device call leaves it: every run's metrics for ``seeds``, a base, a status."""
    for name in ("bf16", "w4"):
        for k in seeds:
            d = work / "runs" / name / f"seed{k}"
            d.mkdir(parents=True)
            (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "acc": acc + k}) + "\n")
    (work / "base").mkdir(parents=True)
    (work / "base/base.json").write_text(json.dumps({"weights_sha256": sha, "eval": {"eval/acc": acc}}))
    (work / f"runs-{suite_name}.json").write_text(json.dumps(
        [{"name": n, "seed": k, "status": "done"} for n in ("bf16", "w4") for k in seeds]))


def test_collect_merges_the_seeds_of_several_calls(tmp_path):
    from quarl.experiments.results import render
    from quarl.experiments.suite import collect

    suite = load_suite(_suite(tmp_path, {"seeds": [0], "table": ["acc"]}))
    out = tmp_path / "out"
    _fake_call(tmp_path / "w1", suite.name, [0], "aaaa", 0.5)
    collect(suite, tmp_path / "w1", out)
    suite.seeds = [1, 2]  # the next call runs the other seeds (quarl suite run --seeds 1,2)
    _fake_call(tmp_path / "w2", suite.name, [1, 2], "bbbb", 0.25)
    collect(suite, tmp_path / "w2", out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["seeds"] == [0, 1, 2] and meta["runs"] == ["bf16", "w4"]
    assert [c["seeds"] for c in meta["calls"]] == [[0], [1, 2]]
    assert [c["base_sha256"] for c in meta["calls"]] == ["aaaa", "bbbb"]
    assert [c["base_eval_acc"] for c in meta["calls"]] == [0.5, 0.25]
    assert meta["calls"][1]["runs"] == ["bf16 seed 1", "bf16 seed 2", "w4 seed 1", "w4 seed 2"]
    status = json.loads((out / "runs.json").read_text())
    assert sorted((r["name"], r["seed"]) for r in status) == [(n, k) for n in ("bf16", "w4") for k in (0, 1, 2)]
    assert json.loads((out / "base.json").read_text())["weights_sha256"] == "bbbb"  # the latest call's
    page = render(out).read_text()
    assert "Run in 2 calls" in page and "the base weights differ between calls" in page
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["w4"]["acc (last)"]["seeds"] == {"0": 0.5, "1": 1.25, "2": 2.25}
    # another suite's results directory is refused
    other = load_suite(_suite(tmp_path, {"seeds": [0]}, name="other"))
    with pytest.raises(ValueError, match="holds the results of suite 's'"):
        collect(other, tmp_path / "w2", out)


def test_weights_digest_follows_the_bytes(tmp_path):
    from quarl.experiments.suite import weights_digest

    (tmp_path / "a").mkdir()
    (tmp_path / "a/model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "b").mkdir()
    (tmp_path / "b/model.safetensors").write_bytes(b"x" * 100)
    assert weights_digest(tmp_path / "a") == weights_digest(tmp_path / "b")
    import hashlib

    assert weights_digest(tmp_path / "a") == hashlib.sha256(b"x" * 100).hexdigest()[:16]
    (tmp_path / "b/model.safetensors").write_bytes(b"x" * 99 + b"y")
    assert weights_digest(tmp_path / "a") != weights_digest(tmp_path / "b")


def test_runs_from_an_earlier_base_start_again(tmp_path):
    """A changed base recipe rebuilds the base; the runs trained from the old one are run again,
    not reported as finished."""
    suite_dir = _tiny_suite(tmp_path)
    work, out = tmp_path / "work", tmp_path / "out"
    args = ("suite", "run", str(suite_dir), "--work", str(work), "--out", str(out), "--seeds", "0", "--only", "bf16",
            "--trainer.steps=1")
    code, first = _main(*args)
    assert code == 0 and "1 of 1 runs complete" in first, first
    code, again = _main(*args)
    assert code == 0 and "finished earlier" in again and "another base" not in again
    code, changed = _main(*args, "--trainer.sft_warmup_steps=6")
    assert code == 0, changed
    assert "base: warm-starting tiny for 6 steps" in changed
    assert "bf16 seed 0: trained from another base" in changed and "finished earlier" not in changed
    assert json.loads((out / "base.json").read_text())["steps"] == 6


def test_run_phases_from_the_rows_wall_times(tmp_path):
    from quarl.experiments.suite import run_phases

    f = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "wall": 90.0}, {"step": 2, "wall": 112.5}, {"step": 3, "wall": 130.0}, {"step": 4}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # launched at 100: the row at 90 is an earlier run's (resumed), left out
    assert run_phases(f, 100.0, 141.0) == {"start": 12.5, "steps": 17.5, "end": 11.0}
    assert run_phases(f, 200.0, 210.0) is None
    assert run_phases(tmp_path / "none.jsonl", 0.0, 1.0) is None
