"""Data and rewards: synthetic tasks, file datasets, verifiers run in a process pool.

    task = build_task(cfg.data)                 # or get_task("countdown", difficulty=2)
    with RewardPool(task.reward_spec, cfg.data.reward_workers, cfg.data.reward_timeout_s) as pool:
        rewards, metrics = pool.score(completions, examples)
"""

from __future__ import annotations

from typing import Any

from quarl.tasks.base import Example, Task
from quarl.tasks.cycles import CycleTask
from quarl.tasks.datasets import DatasetError, FileTask, read_examples
from quarl.tasks.rewards import RewardError, RewardFailed, RewardPool, math_reward, resolve_reward
from quarl.tasks.synthetic import ArithmeticTask, CountdownTask, arith_reward, countdown_reward

__all__ = [
    "ArithmeticTask", "CountdownTask", "CycleTask", "DatasetError", "Example", "FileTask", "RewardError",
    "RewardFailed", "RewardPool", "Task", "arith_reward", "build_task", "countdown_reward", "get_task", "math_reward",
    "read_examples", "resolve_reward",
]


def build_task(cfg: Any) -> Task:
    """The task described by a ``DataConfig`` (task: arith | countdown | cycle | file)."""
    common = dict(system_prompt=cfg.system_prompt, reward=cfg.reward)
    if cfg.task == "file":
        if not cfg.path:
            raise ValueError("data.path is required when data.task is 'file' (a .jsonl or .parquet file)")
        return FileTask(
            cfg.path, cfg.eval_path, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, num_eval=cfg.num_eval,
            **common,
        )
    synthetic = {"arith": ArithmeticTask, "countdown": CountdownTask, "cycle": CycleTask}
    if cfg.task not in synthetic:
        raise ValueError(f"unknown task {cfg.task!r}; choose arith, countdown, cycle or file")
    return synthetic[cfg.task](
        difficulty=cfg.difficulty, num_train=cfg.num_train, num_eval=cfg.num_eval, seed=cfg.seed, **common
    )


def get_task(task: str = "arith", **fields: Any) -> Task:
    """Like :func:`build_task`, from ``DataConfig`` field names: ``get_task("countdown", difficulty=2)``."""
    from quarl.config import DataConfig

    return build_task(DataConfig(task=task, **fields))
