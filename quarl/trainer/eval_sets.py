"""Sampling local data sets with a run's engine and scoring them with its verifier: the work
behind ``quarl eval --data`` (the metrics themselves are pure functions in ``quarl.evaluation``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalSettings:
    n: int
    temperature: float
    top_p: float
    seed: int


def evaluate_sets(cfg, resume: bool, sets: dict, settings: EvalSettings, quiet: bool) -> dict:
    """One scheme: every set sampled, scored and summarised."""
    from rich.console import Console

    from quarl.evaluation import ProblemResult, summarize
    from quarl.trainer.evaluation import build_for_evaluation
    from quarl.trainer.progress import StepProgress

    run = build_for_evaluation(cfg, resume)  # the engine, data and verifier: no learner
    scheme = run.engine.scheme.name
    console = None if quiet else Console(stderr=True)
    total = sum(len(exs) for exs in sets.values())
    out: dict = {"scheme": scheme, "step": run.step, "reward_spec": run.task.reward_spec, "sets": {}}
    done, everything = 0, []
    try:
        with StepProgress(total, 0, console, label=f"eval {scheme}", describe=lambda m: m["info"]) as bar:
            for name, exs in sets.items():
                problems, timeouts, errors = [], 0, 0
                for start in range(0, len(exs), 16):
                    chunk = exs[start:start + 16]
                    correct, stats = score_problems(run, chunk, start, settings)
                    problems += [ProblemResult(start + i, settings.n, c) for i, c in enumerate(correct)]
                    timeouts += int(stats["reward/timeouts"])
                    errors += int(stats["reward/errors"])
                    done += len(chunk)
                    bar.update(done, {"info": f"{name}: {len(problems)}/{len(exs)}"})
                everything += problems
                out["sets"][name] = {
                    **summarize(problems, settings.n), "reward_timeouts": timeouts, "reward_errors": errors,
                    "problems": [{"index": p.index, "n": p.n, "correct": p.correct} for p in problems],
                }
    finally:
        run.rewards.close()
    out["overall"] = summarize(everything, settings.n)
    return out


def score_problems(run, examples: list, first_index: int, settings: EvalSettings) -> tuple[list[int], dict]:
    """Correct samples (reward >= 1) of each example, sampled with ``run``'s engine (an
    :class:`~quarl.trainer.evaluation.EvalRun`)."""
    from quarl.evaluation import problem_seed
    from quarl.rollout import SamplingParams

    tok, r = run.tokenizer, run.cfg.rollout
    prompts = [tok.apply_chat_template(run.task.messages(e))[-run.cfg.data.max_prompt_len:] for e in examples]
    params = [
        SamplingParams(n=settings.n, temperature=settings.temperature, top_p=settings.top_p,
                       max_new_tokens=r.max_new_tokens, stop_token_ids=(tok.eos_token_id,),
                       seed=problem_seed(settings.seed, first_index + i))
        for i in range(len(examples))
    ]
    comps = run.engine.generate(prompts, params)
    texts = [tok.decode(c.token_ids) for c in comps]
    rewards, stats = run.rewards.score(texts, [examples[c.prompt_index] for c in comps])
    correct = [0] * len(examples)
    for c, reward in zip(comps, rewards):
        correct[c.prompt_index] += reward >= 1.0
    return correct, stats
