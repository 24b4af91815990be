"""The real CLI, run as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from quarl.trainer import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
# The demo run shrunk to seconds: the tiny model, no warm-start, 4 prompts x 4 samples, inline rewards.
TINY = [
    "--quiet", "--model.builtin=tiny", "--trainer.prompts_per_step=4", "--rollout.n=4",
    "--rollout.max_new_tokens=8", "--trainer.sft_warmup_steps=0", "--trainer.eval_every=0",
    "--data.num_eval=4", "--data.reward_workers=0", "--trainer.tensorboard=false",
]


def _quarl(*args, check=True, cwd=None, python_flags=(), env=None):
    # PYTHONPATH: this checkout's quarl even when cwd is elsewhere
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    r = subprocess.run([sys.executable, *python_flags, "-m", "quarl", *args], capture_output=True, text=True,
                       timeout=300, cwd=cwd, env=env)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _one_line_error(r, command: str) -> str:
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"quarl {command}: error: ") and "Traceback" not in r.stderr, r.stderr
    return r.stderr


def test_help_lists_commands():
    out = _quarl("--help").stdout
    assert "generate" in out


def test_generate_builtin_and_checkpoint(hf_checkpoint):
    r = _quarl("generate", "--prompt", "12+7=", "--max-new-tokens", "5", "--greedy", "--show-logprobs")
    assert "[5 tokens" in r.stdout and "logprobs:" in r.stdout
    _, path, _ = hf_checkpoint
    r = _quarl("generate", "--model", str(path), "--prompt", "ab", "--max-new-tokens", "3", check=False)
    # tiny HF checkpoints have vocab 96 < the built-in tokenizer's 128: a clear error, exit code 2
    assert r.returncode == 2 and "--tokenizer" in r.stderr


def test_generate_runs_the_engine_in_the_chosen_scheme():
    """The CLI's greedy text is the engine's, in bf16 and in w4a16; -n gives n samples per prompt."""
    import torch

    from quarl.model.presets import build_random_model
    from quarl.rollout import Engine, EngineConfig, SamplingParams
    from quarl.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    ids = tok.apply_chat_template([{"role": "user", "content": "7+12="}])
    for scheme in ("bf16", "w4a16"):
        r = _quarl("generate", "--builtin", "tiny", "--prompt", "7+12=", "--max-new-tokens", "6", "--greedy",
                   "--scheme", scheme)
        engine = Engine(build_random_model("tiny", dtype=torch.float32), scheme=scheme,
                        config=EngineConfig(max_model_len=64, num_kv_blocks=16))
        want = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=6,
                                                     stop_token_ids=(tok.eos_token_id,)))[0]
        assert r.stdout.splitlines()[1] == tok.decode(want.token_ids), scheme
        assert f"on cpu, {scheme}" in r.stdout
    r = _quarl("generate", "--builtin", "tiny", "--prompt", "1+1=", "--prompt", "2+2=", "-n", "3",
               "--max-new-tokens", "4", "--seed", "5")
    assert r.stdout.count("### prompt: 1+1=  (sample") == 3 and r.stdout.count("### prompt: 2+2=") == 3
    assert "unknown quantization scheme 'w5a5'" in _one_line_error(
        _quarl("generate", "--prompt", "x", "--scheme", "w5a5", check=False), "generate")


def test_generate_missing_model_dir(tmp_path):
    r = _quarl("generate", "--model", str(tmp_path / "nope"), "--prompt", "x", check=False)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_bench_commands_need_a_gpu():
    for suite in ("gemm", "rollout", "train"):
        r = _quarl("bench", suite, "--help")
        assert "--out" in r.stdout
        r = _quarl("bench", suite, check=False)
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr


def test_reward_module_is_imported_from_the_working_directory(tmp_path):
    # -P keeps the working directory off sys.path, as the `quarl` console script does
    args = ("train", "--dry-run", "--data.reward=my_rewards:score")
    err = _one_line_error(_quarl(*args, check=False, cwd=tmp_path, python_flags=("-P",)), "train")
    assert "cannot import module 'my_rewards'" in err and "No module named 'my_rewards'" in err
    assert "run from the directory that holds my_rewards.py or set PYTHONPATH" in err
    (tmp_path / "my_rewards.py").write_text("def score(completion, answer, meta):\n    return 1.0\n")
    assert "reward: my_rewards:score" in _quarl(*args, cwd=tmp_path, python_flags=("-P",)).stdout


def test_a_reward_failing_on_every_item_stops_the_run(tmp_path):
    r = _quarl("train", *TINY, f"--trainer.run_dir={tmp_path}", "--data.reward=tests.trainer.reward_fns:always_raises",
               check=False)
    err = _one_line_error(r, "train")
    assert "reward tests.trainer.reward_fns:always_raises failed on all 16 items" in err
    assert "first error: KeyError: 'gold_answer'" in err


def test_a_reward_that_breaks_mid_run_keeps_the_last_checkpoint(tmp_path):
    r = _quarl("train", *TINY, f"--trainer.run_dir={tmp_path}", "--trainer.steps=3", "--trainer.save_every=1",
               "--data.reward=tests.trainer.reward_fns:raises_after_16_calls", check=False)
    assert "raises_after_16_calls failed on all 16 items" in _one_line_error(r, "train")
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest is not None and ckpt.load_checkpoint(latest)["step"] == 1


def test_eval_needs_a_run_dir_or_a_model(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("trainer:\n  steps: 3\n")
    for args in ((), ("--config", str(cfg))):
        err = _one_line_error(_quarl("eval", *args, check=False, cwd=tmp_path), "eval")
        assert "pass a run directory (quarl eval RUN_DIR)" in err and "quarl eval --config run.yaml" in err
        assert "model.path" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # no runs/default left behind


def test_generate_applies_the_chat_template_by_default():
    """The built-in tokenizer has a chat format (the demo model is trained on it): on unless --no-chat."""
    from quarl.cli.generate import prompt_ids
    from quarl.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    assert tok.has_chat_template
    assert prompt_ids(tok, ["7+12="], chat=True) == [tok.apply_chat_template([{"role": "user", "content": "7+12="}])]
    assert prompt_ids(tok, ["7+12="], chat=False) == [tok.encode("7+12=")]

    def logprobs(*flags):
        r = _quarl("generate", "--builtin", "tiny", "--prompt", "7+12=", "--max-new-tokens", "4", "--greedy",
                   "--show-logprobs", *flags)
        return next(line for line in r.stdout.splitlines() if line.startswith("logprobs:"))

    default = logprobs()
    assert default == logprobs("--chat")  # same prompt ids, same greedy log-probs
    assert default != logprobs("--no-chat")


def test_generate_with_fp8_kv_cache_is_the_fp8_engine():
    import torch

    from quarl.model.presets import build_random_model
    from quarl.rollout import Engine, EngineConfig, SamplingParams
    from quarl.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    ids = tok.apply_chat_template([{"role": "user", "content": "7+12="}])
    r = _quarl("generate", "--builtin", "tiny", "--prompt", "7+12=", "--max-new-tokens", "6", "--greedy",
               "--show-logprobs", "--kv-cache-dtype", "fp8")
    engine = Engine(build_random_model("tiny", dtype=torch.float32),
                    config=EngineConfig(max_model_len=64, num_kv_blocks=16, kv_cache_dtype="fp8"))
    want = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=6,
                                                 stop_token_ids=(tok.eos_token_id,)))[0]
    assert r.stdout.splitlines()[1] == tok.decode(want.token_ids)
    assert r.stdout.splitlines()[2] == "logprobs: " + " ".join(f"{x:.3f}" for x in want.logprobs)
    assert "fp8 KV cache" in r.stdout
    r = _quarl("generate", "--prompt", "x", "--kv-cache-dtype", "fp16", check=False)
    assert r.returncode == 2 and "invalid choice: 'fp16'" in r.stderr


def test_under_torchrun_a_user_error_is_printed_once_per_node(monkeypatch, capsys):
    """Every rank meets the same bad setting: rank 0 prints it, the first rank of each other
    node prints it with its rank, the rest exit 2 silently."""
    from quarl.cli.main import main

    bad = ["generate", "--prompt", "x", "--scheme", "w5a5"]
    for rank, local, want in (("0", "0", "quarl generate: error: unknown quantization scheme 'w5a5'"),
                              ("3", "1", ""),
                              ("4", "0", "quarl generate (rank 4, first of its node): error: unknown quantization")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local)
        assert main(bad) == 2
        err = capsys.readouterr().err
        assert err.startswith(want) if want else err == ""


def test_sigusr1_prints_every_threads_stack_and_the_command_goes_on(monkeypatch, capfd):
    """A rank that hangs says where on ``kill -USR1``: Python's stacks on stderr, and the run
    is not stopped by it."""
    import argparse
    import faulthandler
    import signal

    from quarl.cli import main as cli

    def hang_here(args):  # (the command "hangs" here: it signals itself, then finishes)
        os.kill(os.getpid(), signal.SIGUSR1)
        return 7

    parser = argparse.ArgumentParser()
    parser.set_defaults(command="train", run=hang_here)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    try:
        assert cli.main([]) == 7
    finally:
        faulthandler.unregister(signal.SIGUSR1)
    err = capfd.readouterr().err
    assert "hang_here" in err and "most recent call first" in err, err


def _without_triton(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine that never installed triton (the README's main command: the CPU
    torch wheel and the train extra): a sitecustomize marks it absent, so that `import triton` raises
    ModuleNotFoundError and importlib finds no spec, as when it is not installed."""
    site = tmp_path / "no_triton"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\n\nsys.modules['triton'] = None\n")
    return {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}


def test_every_command_but_bench_runs_without_triton(tmp_path):
    env = _without_triton(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **env})
    assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr  # the stand-in does hide it
    assert "COMMAND" in _quarl("--help", env=env).stdout
    assert "trainer:" in _quarl("train", "--dry-run", env=env).stdout
    run = tmp_path / "run"
    _quarl("train", *TINY, f"--trainer.run_dir={run}", "--trainer.steps=2", env=env)
    steps = {json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert steps == {1, 2}
    assert _quarl("report", str(run), env=env).stdout.strip() == str(run / "report.html")
    _quarl("export", str(run), "--out", str(tmp_path / "hf"), env=env)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert "[3 tokens" in _quarl("generate", "--prompt", "1+1=", "--max-new-tokens", "3", "--greedy", env=env).stdout
    assert json.loads(_quarl("eval", str(run), "--quiet", env=env).stdout)["step"] == 2
    for suite in (("gemm",), ("sweep", "wgmma", "--list")):  # (--list needs no GPU, but the kernels' configs)
        r = _quarl("bench", *suite, check=False, env=env)
        assert r.returncode == 2, r.stderr
        assert r.stderr == ('quarl bench: error: this needs the Python package triton, which is not installed: '
                            'pip install -e ".[triton]"\n')
    assert "--out" in _quarl("bench", "gemm", "--help", env=env).stdout  # the help still lists the suite's flags


def test_a_model_path_that_does_not_exist_says_so(tmp_path):
    """The tokenizer is read first: it used to say the path 'has no tokenizer files'."""
    for extra in ((), ("--model.tokenizer=builtin",)):  # the tokenizer's look, then the weights'
        r = _quarl("train", "--model.path=/nonexistent", *extra, f"--trainer.run_dir={tmp_path / 'run'}", check=False)
        err = _one_line_error(r, "train")
        assert "'/nonexistent' does not exist" in err and "at a local Hugging Face model directory" in err, err
        assert "tokenizer files" not in err
    data = tmp_path / "d.jsonl"  # and a data file's bad line is placed where it is
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+1=", "answer": "2"\n')
    r = _quarl("train", "--data.task=file", f"--data.path={data}", f"--trainer.run_dir={tmp_path / 'run2'}",
               check=False)
    assert f"{data}, line 2: bad JSON (Expecting ',' delimiter at column 33)" in _one_line_error(r, "train")


def test_hints_name_flags_of_the_command_that_was_run(tmp_path):
    """A hint names a flag the user's command has: generate's own --model / --tokenizer, the run
    config's --model.* for train (which has neither)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _quarl("train", f"--model.tokenizer={empty}", f"--trainer.run_dir={tmp_path / 'run'}", check=False)
    err = _one_line_error(r, "train")
    assert f"'{empty}' has no tokenizer files" in err and "point --model.tokenizer at" in err, err
    assert "--tokenizer " not in err and "quarl generate" not in err
    for flag, path, words in (("--tokenizer", empty, "has no tokenizer files"),
                              ("--tokenizer", tmp_path / "nope", "does not exist"),
                              ("--model", tmp_path / "nope", "does not exist")):
        err = _one_line_error(_quarl("generate", "--prompt", "x", flag, str(path), check=False), "generate")
        assert err.startswith(f"quarl generate: error: {flag} {path} {words}"), err
        assert "--model." not in err
    assert "--tokenizer builtin" in _one_line_error(
        _quarl("generate", "--prompt", "x", "--tokenizer", str(empty), check=False), "generate")


def test_the_issue_s_out_of_range_values_fail_through_the_cli():
    for flag, words in (("--algo.eps_low=-1", "algo.eps_low must be in [0, 1), got -1.0"),
                        ("--quant.include=5", "quant.include pattern '5' matches no linear layer")):
        err = _one_line_error(_quarl("train", "--dry-run", flag, check=False), "train")
        assert words in err, err
