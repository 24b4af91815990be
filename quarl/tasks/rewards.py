"""Reward functions and the process pool that runs them with a timeout per item.

Every reward function has one signature::

    fn(completion: str, answer: str, meta: dict) -> float

``completion`` is the decoded response, ``answer`` the example's gold answer and
``meta`` the example's extra fields. Functions are named by import path,
``"package.module:function"``, because that is how they reach worker processes.

Verifiers are user code: they may hang (a pathological sympy simplification) or crash.
:class:`RewardPool` scores a batch in worker processes started with the "spawn"
context (a fork of a process with torch threads is not safe). Each worker runs one
item at a time, so the parent knows which item each worker holds and since when: an
item that outlives ``timeout_s`` gets reward 0 and its worker is killed and replaced,
a function that raises or returns a non-number gets 0, a worker that dies is
replaced; the rest of the batch is scored meanwhile, so a bad verifier never stalls
training. Both are counted in the metrics ``reward/timeouts`` and ``reward/errors``.
A function that scores no item of a batch (every one raised or timed out) is broken,
not unlucky: :meth:`RewardPool.score` raises :class:`RewardFailed` naming the first error
or the timeout.

Timeouts are per item, so a verifier that hangs on everything would hold each worker
for ``timeout_s`` per item: a batch of N items would take N / workers timeouts. When
2 x workers items in a row have timed out (every worker twice: one slow item is not
a hang) and no item of the batch has finished, and the previous batch scored none
either (a fresh pool has no previous batch), the verifier is taken to hang: the rest
of the batch counts as timed out without being tried, so such a batch takes about
two timeouts.

``score(..., stop=fn)``: once ``fn()`` is true (a Ctrl-C asked the run to stop) the
pool gives the items in flight :data:`STOP_GRACE_S` more seconds, then kills the
workers still busy and raises :class:`ScoringInterrupted`, so that a hung verifier
cannot hold up a stop.
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing as mp
import numbers
import os
import signal
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from quarl.tasks.example import Example

RewardFn = Callable[[str, str, dict], float]
MATH_REWARD = "quarl.tasks.rewards:math_reward"

log = logging.getLogger(__name__)


class RewardError(ValueError):
    """The reward function cannot be loaded, its workers cannot start, or it fails on every item.

    A ValueError, so the CLI reports it as one line (exit 2) like other bad input.
    """


class RewardFailed(RewardError):
    """No item of a batch was scored (each raised, returned a non-number or timed out): training on
    all-zero rewards is pointless."""


class ScoringInterrupted(Exception):
    """A stop was asked for while the verifier was still busy (:meth:`RewardPool.score`'s ``stop``)."""


STOP_GRACE_S = 1.0  # how long items in flight may still finish once a stop is asked for


def reward_spec(choice: str, builtin: str) -> str:
    """Map a config value (``builtin`` | ``math`` | ``module:function``) to an import path."""
    if choice == "builtin":
        if not builtin:
            raise ValueError("this task has no built-in reward; set data.reward to 'math' or 'module:function'")
        return builtin
    if choice == "math":
        return MATH_REWARD
    return choice


def resolve_reward(spec: str) -> RewardFn:
    """Import ``"module:function"``; errors say which part is wrong."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(
            f"reward {spec!r} must be 'builtin', 'math' or an import path 'module:function' "
            "(e.g. 'my_rewards:score' with fn(completion, answer, meta) -> float)"
        )
    module_name, attr_path = spec.split(":")
    _add_working_dir_to_path()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        file = module_name.split(".")[0] + ".py"
        raise RewardError(
            f"cannot import module {module_name!r} of reward {spec!r} ({type(e).__name__}: {e}); the module must "
            f"be importable from the working directory or PYTHONPATH: run from the directory that holds {file} "
            "or set PYTHONPATH"
        ) from e
    obj: Any = module
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise RewardError(
                f"module {module_name!r} has no function {attr_path!r} (reward {spec!r}); "
                f"its functions: {', '.join(names) or 'none'}"
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise RewardError(f"reward {spec!r} is a {type(obj).__name__}, not a function")
    if spec == MATH_REWARD:
        _math_verify()  # a missing dependency fails now, not in the middle of training
    return obj


def _add_working_dir_to_path() -> None:
    """Make modules in the working directory importable, as docs/configuration.md promises.

    ``python -m quarl`` puts the working directory on ``sys.path`` (as ``""``) but the
    ``quarl`` console script puts its own bin directory there instead. Spawned workers
    get the parent's ``sys.path`` with ``""`` replaced by the directory the parent
    *started* in, so the absolute path is added too: workers then import what the
    parent imports even after a chdir. Appended, so it never shadows an installed module.
    """
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)


def _spec_of(fn: RewardFn) -> str:
    """The import path of a module-level function, or an error for lambdas/closures."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname:
        spec = f"{module}:{qualname}"
        try:
            if resolve_reward(spec) is fn:
                return spec
        except (RewardError, ValueError):
            pass
    raise ValueError(
        f"reward function {fn!r} cannot be sent to worker processes; pass it as an import "
        "path 'module:function' of a module-level function (or use workers=0)"
    )


def _name(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _call(fn: RewardFn, completion: str, answer: str, meta: dict) -> float:
    value = fn(completion, answer, meta)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward function returned {type(value).__name__}, expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward function returned {value}")
    return value


# --------------------------------------------------------------------------- workers


def _worker_main(spec: str, conn: Connection) -> None:
    """Worker loop. Messages out: ("ready",), ("init_error", msg), ("result", i, reward, error)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    try:
        fn = resolve_reward(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        index, completion, answer, meta = job
        try:
            conn.send(("result", index, _call(fn, completion, answer, meta), None))
        except BaseException as e:  # noqa: BLE001 - a verifier's failure is a zero reward
            conn.send(("result", index, 0.0, f"{type(e).__name__}: {e}"))


class _Worker:
    """One worker process and the item it holds (``job`` = (index, start time))."""

    def __init__(self, ctx: Any, spec: str) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(spec, child), daemon=True, name="quarl-reward")
        self.process.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.job: tuple[int, float] | None = None

    def stop(self, graceful: bool) -> None:
        if graceful and self.process.is_alive():
            try:
                self.conn.send(None)
                self.process.join(1.0)
            except (OSError, ValueError):
                pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self.conn.close()


class RewardPool:
    """Score batches with ``fn(completion, answer, meta)`` in ``workers`` processes.

    ``fn`` is a ``"module:function"`` path (or a module-level function, turned into
    its path). ``workers=0`` scores inline in this process, with no timeout. Each item
    gets at most ``timeout_s`` seconds from the moment a worker takes it.
    ``startup_timeout_s`` bounds a worker's start (importing the reward's module).

        with RewardPool(task.reward_spec, workers=2, timeout_s=5.0) as pool:
            rewards, metrics = pool.score(completions, examples)
    """

    def __init__(
        self,
        fn: str | RewardFn,
        workers: int = 2,
        timeout_s: float = 5.0,
        startup_timeout_s: float = 60.0,
        context: str = "spawn",
    ) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isinstance(fn, str):
            self.spec: str | None = fn
            self.fn = resolve_reward(fn)
        else:
            self.fn = fn
            self.spec = _spec_of(fn) if workers > 0 else None
        self.timeout_s = timeout_s
        self.startup_timeout_s = max(startup_timeout_s, timeout_s)
        self._ctx = mp.get_context(context)
        self._workers = [_Worker(self._ctx, self.spec) for _ in range(workers)]
        self._scored_last_batch = False  # (see the module's docstring: when a verifier is taken to hang)

    @property
    def workers(self) -> int:
        return len(self._workers)

    def score(self, completions: list[str], examples: list[Example],
              stop: Callable[[], bool] | None = None) -> tuple[list[float], dict[str, float]]:
        """Rewards in input order, and ``{"reward/timeouts": n, "reward/errors": n}``. ``stop``:
        see the module's docstring (workers only; inline scoring is stopped by a second Ctrl-C)."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
        jobs = [(c, ex.answer, ex.meta) for c, ex in zip(completions, examples)]
        rewards = [0.0] * len(jobs)
        counts = {"timeouts": 0, "errors": 0, "untried": 0}
        errors: list[str] = []
        if self._workers:
            self._score_in_workers(jobs, rewards, counts, errors, stop)
        else:
            for i, job in enumerate(jobs):
                try:
                    rewards[i] = _call(self.fn, *job)
                except Exception as e:  # noqa: BLE001 - a verifier's failure is a zero reward
                    counts["errors"] += 1
                    errors.append(f"{type(e).__name__}: {e}")
        self._scored_last_batch = counts["errors"] + counts["timeouts"] < len(jobs)
        if jobs and not self._scored_last_batch:
            raise RewardFailed(self._failure(len(jobs), counts, errors))
        if errors or counts["timeouts"]:
            first = f"; first error: {errors[0]}" if errors else ""
            log.warning(
                "reward %s: %d of %d items timed out (> %.1fs), %d failed%s",
                self.spec or self.fn, counts["timeouts"], len(jobs), self.timeout_s, counts["errors"], first,
            )
        return rewards, {"reward/timeouts": float(counts["timeouts"]), "reward/errors": float(counts["errors"])}

    def _failure(self, items: int, counts: dict[str, int], errors: list[str]) -> str:
        """Why no item of a batch was scored, with the fix."""
        name, timeouts, failed = self.spec or _name(self.fn), counts["timeouts"], counts["errors"]
        if not timeouts:
            return (f"reward {name} failed on all {items} items of the batch, so every reward would be 0; first "
                    f"error: {errors[0]}. Fix the reward function (run it on one completion by hand to see the "
                    "traceback)")
        untried = (f"; the last {counts['untried']} were not tried, as every worker had hung twice"
                   if counts["untried"] else "")
        what = (f"timed out on all {items} items of the batch (> {self.timeout_s:g} s each{untried})" if not failed
                else f"failed on {failed} and timed out on {timeouts} of the {items} items of the batch "
                     f"(first error: {errors[0]})")
        return (f"reward {name} {what}, so every reward would be 0: it hangs or is too slow. Fix the reward "
                "function (run it on one completion by hand), or if it is only slow raise "
                f"data.reward_timeout_s (now {self.timeout_s:g})")

    def _score_in_workers(self, jobs: list[tuple[str, str, dict]], rewards: list[float], counts: dict[str, int],
                          errors: list[str], stop: Callable[[], bool] | None) -> None:
        pending = deque(range(len(jobs)))
        hung = scored = 0  # timeouts since the last item that finished; items that finished
        stop_seen: float | None = None
        while pending or any(w.job is not None for w in self._workers):
            for slot, w in enumerate(self._workers):
                if w.ready and w.job is None and pending:
                    i = pending.popleft()
                    try:
                        w.conn.send((i, *jobs[i]))
                        w.job = (i, time.monotonic())
                    except (OSError, ValueError):  # the idle worker died: replace it, retry the item
                        pending.appendleft(i)
                        self._replace(slot)
            # with a stop hook, wake often enough to see the stop (a signal does not end the wait)
            limit = self._next_deadline() - time.monotonic()
            wait([w.conn for w in self._workers], timeout=min(limit, 0.1) if stop is not None else limit)
            for slot in range(len(self._workers)):
                finished, timed_out = self._collect(slot, rewards, counts, errors)
                scored += finished
                hung = 0 if finished else hung + timed_out
            if stop is not None and stop_seen is None and stop():
                stop_seen = time.monotonic()
            if stop_seen is not None and time.monotonic() - stop_seen >= STOP_GRACE_S:
                self._abandon_busy(counts)
                raise ScoringInterrupted(f"reward {self.spec}: stopped with {len(pending)} items left")
            if hung >= 2 * len(self._workers) and not scored and not self._scored_last_batch:
                counts["untried"] = len(pending)
                counts["timeouts"] += len(pending)
                pending.clear()
                self._abandon_busy(counts)

    def _abandon_busy(self, counts: dict[str, int]) -> None:
        """Kill and replace the workers that still hold an item (counted as a timeout)."""
        for slot, w in enumerate(self._workers):
            if w.job is not None:
                counts["timeouts"] += 1
                self._replace(slot)

    def _next_deadline(self) -> float:
        deadlines = [
            w.job[1] + self.timeout_s if w.job else w.started + self.startup_timeout_s
            for w in self._workers
            if w.job or not w.ready
        ]
        return min(deadlines, default=time.monotonic() + self.timeout_s)

    def _collect(self, slot: int, rewards: list[float], counts: dict[str, int], errors: list[str]
                 ) -> tuple[int, int]:
        """Read the worker's messages; replace it if it died, hung, or never started. The items
        it finished (scored or raised) and whether its item timed out."""
        w = self._workers[slot]
        finished = 0
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready = True
                elif msg[0] == "result":
                    _, i, value, error = msg
                    rewards[i] = value
                    finished += 1
                    if error is not None:
                        counts["errors"] += 1
                        errors.append(error)
                    w.job = None
                else:
                    raise RewardError(f"reward worker could not load {self.spec!r}: {msg[1]}")
            alive = w.process.is_alive()
        except (EOFError, OSError):
            alive = False
        now = time.monotonic()
        if not alive and not w.ready:
            w.process.join(1.0)
            raise RewardError(
                f"reward worker exited while starting (exit code {w.process.exitcode}). Workers are "
                "started with 'spawn', which re-imports the main script: if it has no "
                "`if __name__ == '__main__':` guard, add one (or use workers=0)"
            )
        if not alive:
            if w.job is not None:
                counts["errors"] += 1
                errors.append(f"worker died (exit code {w.process.exitcode})")
                finished += 1  # (it answered, by dying: not a hang)
            self._replace(slot)
        elif w.job is not None and now - w.job[1] >= self.timeout_s:
            counts["timeouts"] += 1
            self._replace(slot)
            return finished, 1
        elif not w.ready and now - w.started >= self.startup_timeout_s:
            raise RewardError(
                f"reward worker did not start within {self.startup_timeout_s:.0f}s (importing {self.spec!r})"
            )
        return finished, 0

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop(graceful=False)
        self._workers[slot] = _Worker(self._ctx, self.spec)

    def close(self) -> None:
        for w in self._workers:
            w.stop(graceful=True)
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# --------------------------------------------------------------------------- math-verify


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise RewardError(
            """the 'math' reward needs math-verify: pip install -e ".[train]" (or pip install math-verify)"""
        ) from e
    return math_verify


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for end in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start : end + 1]
    return None


def math_reward(completion: str, answer: str, meta: dict | None = None) -> float:
    """1.0 if the completion's last ``\\boxed{...}`` equals ``answer``, else 0.0.

    Equality is math-verify's (``1/2``, ``0.5`` and ``\\frac{1}{2}`` agree). The gold
    answer is read as if boxed. math-verify bounds its own work with SIGALRM, which
    only works in a main thread: elsewhere it runs without that inner timeout (the
    ``RewardPool`` timeout still applies).
    """
    mv = _math_verify()
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(last_boxed(answer) or f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {answer!r}")
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    pred = mv.parse(boxed, parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if mv.verify(gold, pred, timeout_seconds=timeout) else 0.0
