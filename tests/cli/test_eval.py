"""``quarl eval --data``: the real CLI on a tiny trained run, checked against the engine by hand."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import TINY, _one_line_error, _quarl
from tests.trainer.reward_fns import even_length

PROBLEMS = [("1+2=", "3"), ("4+5=", "9"), ("7+1=", "8"), ("2+2=", "4"), ("9+3=", "12")]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    _quarl("train", *TINY, f"--trainer.run_dir={run_dir}", "--trainer.steps=1", "--trainer.save_every=1")
    return run_dir


def _write_set(path, rows):
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return path


def _by_hand(run_dir, rows, n, temperature, seed, overrides=(), max_new_tokens=8):
    """Correct counts of the run's engine sampled in this process, one prompt at a time, scored by
    calling the verifier."""
    from quarl.config import load_run_config
    from quarl.evaluation import problem_seed
    from quarl.rollout import SamplingParams
    from quarl.trainer.loop import Trainer

    cfg = load_run_config(str(run_dir / "config.yaml"), [f"--trainer.run_dir={run_dir}", *overrides])
    trainer = Trainer(cfg, resume=True, evaluation_only=True)
    tok = trainer.tokenizer
    counts = []
    for i, (prompt, answer) in enumerate(rows):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
        params = SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                                stop_token_ids=(tok.eos_token_id,), seed=problem_seed(seed, i))
        comps = trainer.engine.generate([ids], params)
        counts.append(sum(even_length(tok.decode(c.token_ids), answer, {}) >= 1.0 for c in comps))
    trainer.rewards.close()
    return counts


def test_eval_sets_agree_with_the_engine_scored_by_hand(tiny_run, tmp_path):
    a = _write_set(tmp_path / "mini.jsonl", PROBLEMS)
    b = _write_set(tmp_path / "other.jsonl", PROBLEMS[:2])
    out = tmp_path / "res.json"
    r = _quarl("eval", str(tiny_run), "--data", str(a), "--data", str(b), "--n", "4", "--temperature", "1.0",
               "--seed", "3", "--reward", "tests.trainer.reward_fns:even_length", "--out", str(out))
    assert "pass@4" in r.stdout and "avg@4" in r.stdout and "overall" in r.stdout
    res = json.loads(out.read_text())
    assert set(res) == {"sets", "overall", "config"} and set(res["sets"]) == {"mini", "other"}
    got = [p["correct"] for p in res["sets"]["mini"]["problems"]]
    want = _by_hand(tiny_run, PROBLEMS, n=4, temperature=1.0, seed=3)
    assert got == want
    assert 0 < sum(got) < 4 * len(PROBLEMS)  # a mix of right and wrong: the comparison means something
    assert [p["n"] for p in res["sets"]["mini"]["problems"]] == [4] * 5
    assert res["sets"]["mini"]["avg@4"] == pytest.approx(sum(want) / 20)
    assert set(res["sets"]["mini"]["pass@k"]) == {"1", "2", "4"}
    assert res["overall"]["num_problems"] == 7 and res["config"]["seed"] == 3
    # the same seed gives the same samples; the set named "other" holds the first two problems again
    assert [p["correct"] for p in res["sets"]["other"]["problems"]] == want[:2]
    # greedy (--n 1, temperature 0 by default), in two schemes side by side
    _quarl("eval", str(tiny_run), "--data", str(a), "--scheme", "bf16,w4a16",
           "--reward", "tests.trainer.reward_fns:even_length", "--out", str(out))
    res = json.loads(out.read_text())
    assert set(res["schemes"]) == {"bf16", "w4a16"} and res["config"]["temperature"] == 0.0
    def greedy(scheme):
        return [p["correct"] for p in res["schemes"][scheme]["sets"]["mini"]["problems"]]

    # the run trained w4a16 (aligned): its own engine; bf16: the same weights in a bf16 engine
    assert greedy("w4a16") == _by_hand(tiny_run, PROBLEMS, n=1, temperature=0.0, seed=0)
    assert greedy("bf16") == _by_hand(tiny_run, PROBLEMS, n=1, temperature=0.0, seed=0,
                                      overrides=("--quant.scheme=bf16", "--quant.mode=bf16"))
    assert set(res["schemes"]["w4a16"]["sets"]["mini"]["pass@k"]) == {"1"}


def test_eval_without_data_is_greedy_on_the_eval_split(tiny_run):
    metrics = json.loads(_quarl("eval", str(tiny_run)).stdout)
    assert set(metrics) >= {"eval/acc", "eval/reward_mean", "step"} and metrics["step"] == 1
    err = _one_line_error(_quarl("eval", str(tiny_run), "--n", "4", "--out", "x.json", check=False), "eval")
    assert "--n, --out need --data" in err


def test_eval_builds_the_engine_data_and_verifier_but_no_learner(tiny_run, monkeypatch, capsys):
    from quarl.cli.main import main
    from quarl.learner.learner import Learner

    def refused(*args, **kwargs):
        raise AssertionError("quarl eval built a learner")

    monkeypatch.setattr(Learner, "__init__", refused)
    assert main(["eval", str(tiny_run)]) == 0
    out = capsys.readouterr().out
    metrics = json.loads(out[out.index("{"):])
    assert metrics["step"] == 1 and 0.0 <= metrics["eval/acc"] <= 1.0


def test_eval_malformed_data_names_file_and_line(tiny_run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    err = _one_line_error(_quarl("eval", str(tiny_run), "--data", str(bad), check=False), "eval")
    assert f"{bad}, line 2: bad JSON" in err and err.count("\n") == 1
    missing = _write_set(tmp_path / "q.jsonl", PROBLEMS)
    err = _one_line_error(_quarl("eval", str(tiny_run), "--data", str(missing), "--data.answer_key=solution_text",
                                 check=False), "eval")
    assert f"{missing}, line 1: missing key 'solution_text'" in err


def test_eval_cuts_off_a_hung_verifier(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setenv("QUARL_TEST_HANG_MARKER", str(tmp_path / "hung"))
    data = _write_set(tmp_path / "mini.jsonl", PROBLEMS)
    out = tmp_path / "res.json"
    r = _quarl("eval", str(tiny_run), "--data", str(data), "--n", "2", "--temperature", "1.0",
               "--reward", "tests.trainer.reward_fns:hang_once", "--reward-timeout", "1", "--out", str(out))
    res = json.loads(out.read_text())
    assert (tmp_path / "hung").exists() and res["sets"]["mini"]["reward_timeouts"] == 1
    assert "hang_once: 1 of 10 items timed out (> 1.0s)" in r.stderr  # cut off, scored 0, the rest scored
    assert "verifier timeouts (scored 0)" in r.stdout


def test_eval_a_model_directory_on_a_parquet_set(tiny_run, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    hf = tmp_path / "hf"
    _quarl("export", str(tiny_run), "--out", str(hf), "--format", "hf-fp32")
    data = tmp_path / "pq_set.parquet"
    pq.write_table(pa.table({"question": [p for p, _ in PROBLEMS], "answer": [a for _, a in PROBLEMS]}), data)
    out = tmp_path / "res.json"
    _quarl("eval", "--model", str(hf), "--model.tokenizer=builtin", "--data", str(data),
           "--data.prompt_key=question", "--reward", "tests.trainer.reward_fns:even_length", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["config"]["model"] == str(hf) and res["sets"]["pq_set"]["num_problems"] == 5
    assert [p["n"] for p in res["sets"]["pq_set"]["problems"]] == [1] * 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "pq_set.parquet", "res.json"]  # no run left


def test_eval_of_a_run_without_a_checkpoint_fails_rather_than_score_an_untrained_model(tmp_path):
    (tmp_path / "config.yaml").write_text(_quarl("train", "--dry-run", *TINY).stdout)  # a run that never saved
    err = _one_line_error(_quarl("eval", str(tmp_path), check=False), "eval")
    assert f"{tmp_path} has no checkpoint to evaluate" in err and "quarl train --resume" in err
    assert "starting from step 0" not in err and err.count("\n") == 1
