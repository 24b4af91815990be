"""The rollout engine: requests in, completions with per-token log-probs out."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quarl.model.transformer import Transformer
from quarl.quant import QuantLinear, get_scheme, load_published, quantize_model
from quarl.rollout.block_manager import BlockManager
from quarl.rollout.config import EngineConfig
from quarl.rollout.kv_cache import KVCache
from quarl.rollout.model_runner import DecodeHandle, ModelRunner
from quarl.rollout.sampler import completion_key
from quarl.rollout.sampling_params import SamplingParams
from quarl.rollout.scheduler import ScheduledBatch, Scheduler
from quarl.rollout.sequence import RouteLog, Sequence, SequenceStatus


class LogprobMismatchError(RuntimeError):
    """The engine's log-probs of a reference sequence differ from the learner's."""


@dataclass
class Completion:
    """One sampled completion of one prompt.

    ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under ``softmax(logits / T)``
    before top-k/top-p truncation (under ``softmax(logits)`` for greedy requests).

    ``routes`` (an engine that records routes, on an MoE model; else None): ``[len(prompt) +
    len(token_ids), moe layers, k]`` int16, the experts each prompt and response position ran
    in each MoE layer (the layers in order), as the engine ran them: the prompt's rows from
    the prefill its samples shared (or the recompute after a preemption), the response's from
    the decode steps. The last token was sampled but never fed: its row is ``-1``.
    """

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    routes: np.ndarray | None = None


@dataclass
class GenerateStats:
    """Counters of the last ``generate`` call."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    planned_steps: int = 0  # decode steps whose inputs were prepared while the step before ran
    decode_batch_sizes: list[int] = field(default_factory=list)
    decode_step_s: list[float] = field(default_factory=list)


class Engine:
    """Continuous-batching generation over a paged KV cache (see the package docstring).

    ``model`` is a :class:`Transformer` or a checkpoint directory; ``scheme`` a
    ``quarl.quant.QuantScheme`` or a scheme name (``None`` = ``"bf16"``); ``engine.scheme``
    is always the scheme the engine runs. A quantized scheme swaps the decoder linears
    selected by ``include``/``exclude`` (fnmatch patterns over module names, default
    every ``layers.*`` linear) for ``quarl.quant.QuantLinear`` holding packed weights;
    embeddings, norms and the LM head stay in the model dtype.

    ``record_routes``: on an MoE model, every completion carries the experts its positions
    ran (:attr:`Completion.routes`; :class:`~quarl.rollout.model_runner.ModelRunner`); off, or
    on a dense model, nothing is recorded.
    """

    def __init__(
        self,
        model: Transformer | str | Path,
        scheme: Any = None,
        config: EngineConfig | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        include: list[str] | None = None,
        exclude: list[str] | tuple[str, ...] = (),
        kv_cache: bool = True,
        record_routes: bool = False,
    ) -> None:
        """``kv_cache=False``: the KV cache is sized and made at the first
        :meth:`reallocate_kv_cache`, from the memory free then (for a caller that frees memory
        after building the engine: a learner about to be sharded over the ranks)."""
        if not isinstance(model, Transformer):
            from quarl.model.quantized_loading import load_quantized_model

            device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
            # a low-bit scheme's linears are quantized as they load, one at a time: a checkpoint
            # whose bf16 weights would not fit on the device still runs in its packed form
            model = load_quantized_model(model, "bf16" if scheme is None else scheme, dtype=dtype, device=device,
                                         include=include, exclude=exclude)
        self.model = model.eval()
        self.scheme = get_scheme("bf16" if scheme is None else scheme)
        if self.scheme.quantizes_weights or self.scheme.quantizes_activations:
            quantize_model(self.model, self.scheme, QuantLinear, include=include, exclude=exclude)
        mc = self.model.config
        config = config or EngineConfig()
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=min(mc.max_position_embeddings, 4096))
        self.config = config
        self.max_model_len = config.max_model_len
        self.eos_ids = frozenset(
            [] if mc.eos_token_id is None
            else [mc.eos_token_id] if isinstance(mc.eos_token_id, int) else mc.eos_token_id
        )
        self.runner = ModelRunner(self.model, self.config, self.max_model_len, allocate=kv_cache,
                                  record_routes=record_routes)
        self.block_manager: BlockManager | None = None
        self.scheduler: Scheduler | None = None
        if kv_cache:
            self._schedule_over_cache()
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(0x5EED)
        self.stats = GenerateStats()

    def _schedule_over_cache(self) -> None:
        """The block manager and scheduler over the runner's sized cache."""
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size)
        if self.block_manager.blocks_for(self.max_model_len) > self.runner.num_blocks:
            raise ValueError(
                f"KV cache of {self.runner.num_blocks} blocks cannot hold one sequence of max_model_len="
                f"{self.max_model_len}; raise num_kv_blocks or lower max_model_len"
            )
        self.scheduler = Scheduler(self.config, self.block_manager, self.max_model_len)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Complete every prompt ``n`` times; completions sorted by (prompt, sample)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompt_token_ids)
        if len(sampling_params) != len(prompt_token_ids):
            raise ValueError(f"{len(prompt_token_ids)} prompts but {len(sampling_params)} SamplingParams")
        if self.runner.kv is None:
            raise RuntimeError("the KV cache is released; call engine.reallocate_kv_cache() first")
        seqs: list[Sequence] = []
        for i, (prompt, params) in enumerate(zip(prompt_token_ids, sampling_params)):
            group = self._make_group(i, list(prompt), params)
            seqs.extend(group)
            for unit in [group] if self.config.share_prompt else [[s] for s in group]:
                self.scheduler.add(unit)
        stats = GenerateStats(prompt_tokens=sum(len(p) for p in prompt_token_ids))
        preempt0 = self.scheduler.num_preemptions
        # a launched decode step whose tokens are not collected yet: (batch, handle)
        pending: tuple[ScheduledBatch, DecodeHandle] | None = None
        while pending is not None or not self.scheduler.is_finished():
            t0 = time.perf_counter()
            if pending is None:
                batch = self.scheduler.schedule()
                if batch.is_prefill:
                    token_ids, logprobs = self.runner.step(True, batch.groups, batch.block_copies)
                    if self.records_routes:
                        self._record_prefill(batch.groups, self.runner.prefill_routes)
                    self.scheduler.postprocess(batch.seqs, token_ids, logprobs)
                    stats.prefill_steps += 1
                    stats.prefill_s += time.perf_counter() - t0
                    continue
                self.runner.prepare_decode(batch.seqs, batch.block_copies)
                pending = (batch, self.runner.launch_decode())
            batch, handle = pending
            # while the GPU runs this step, plan the next one and queue it behind it, so
            # the GPU does not wait for the host between steps
            following = self.scheduler.lookahead(batch) if self.config.lookahead else None
            pending = None
            if following is not None:
                self.runner.prepare_decode(following.seqs, following.block_copies, ahead=1)
                pending = (following, self.runner.launch_decode())
                stats.planned_steps += 1
            # (rows of sequences that stopped at the step ahead are dropped by postprocess)
            token_ids, logprobs = self.runner.collect_decode(handle)
            if self.records_routes:  # (read before the step after next reuses this host slot)
                self._record_decode(batch.seqs, self.runner.decode_routes(handle))
            self.scheduler.postprocess(batch.seqs, token_ids, logprobs)
            dt = time.perf_counter() - t0
            stats.decode_steps += 1
            stats.decode_s += dt
            stats.decode_batch_sizes.append(len(batch.seqs))
            stats.decode_step_s.append(dt)
        stats.preemptions = self.scheduler.num_preemptions - preempt0
        stats.generated_tokens = sum(s.num_generated for s in seqs)
        self.stats = stats
        return [
            Completion(s.prompt_index, s.sample_index, s.generated_token_ids, s.logprobs, s.finish_reason or "length",
                       s.routes.rows(len(s)) if s.routes is not None else None)
            for s in seqs
        ]

    @property
    def records_routes(self) -> bool:
        """Whether completions carry their routes (``record_routes`` on an MoE model)."""
        return self.runner.routing is not None

    @staticmethod
    def _record_prefill(groups: list[list[Sequence]], routes: np.ndarray) -> None:
        """A prefill's expert ids (its leaders' tokens in order) as each group's prefix: one
        array the group's members share (the prompt's K/V, which they all read, came from it)."""
        start = 0
        for group in groups:
            end = start + len(group[0])
            rows = routes[start:end].copy()  # (its own array: the step's may be much larger)
            for seq in group:
                seq.routes.set_prefix(rows)
            start = end

    @staticmethod
    def _record_decode(seqs: list[Sequence], routes: np.ndarray) -> None:
        """A decode step's expert ids: row ``i`` is the input token of ``seqs[i]``, at position
        ``len(seq) - 1`` until this step's token is appended. A sequence that stopped at the
        step before (a row planned ahead) ran a token nobody reads: not kept."""
        for seq, row in zip(seqs, routes):
            if seq.status != SequenceStatus.FINISHED:
                seq.routes.put(len(seq) - 1, row)

    def _make_group(self, prompt_index: int, prompt: list[int], params: SamplingParams) -> list[Sequence]:
        if not prompt:
            raise ValueError(f"prompt {prompt_index} is empty")
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt {prompt_index}: {len(prompt)} prompt + {params.max_new_tokens} new tokens exceed "
                f"max_model_len={self.max_model_len}"
            )
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        group = [
            Sequence(next(self._seq_ids), prompt, params, prompt_index, j, completion_key(seed, j), stop)
            for j in range(params.n)
        ]
        if self.records_routes:
            for seq in group:
                seq.routes = RouteLog(len(self.runner.moe_layers), self.runner.route_k)
        return group

    # ------------------------------------------------------------------ weights
    def load_weights(self, published: dict[str, Any]) -> None:
        """Copy published weights into the model in place (storage kept: graphs stay valid).

        Keys are parameter names, with or without HF's ``model.`` prefix; values are
        tensors (any float dtype, cast on copy) or, for a quantized linear, the
        ``QuantizedWeight`` that ``QuantLinear.load_quantized`` takes (keyed by the
        module name or ``<module>.weight``).
        """
        load_published(self.model, published)

    def check_logprobs(
        self, token_ids: list[int], reference_logprobs: Any, tol: float | None = None
    ) -> float:
        """Max |engine - reference| log-prob of ``token_ids[1:]`` given their prefixes.

        ``reference_logprobs`` has ``len(token_ids) - 1`` entries (the learner's
        ``log_softmax(logits)`` of each next token). Raises
        :class:`LogprobMismatchError` when ``tol`` is given and exceeded, e.g. right
        after ``load_weights`` to catch stale or mis-published weights.
        """
        if self.runner.kv is None:
            raise RuntimeError("the KV cache is released; call engine.reallocate_kv_cache() first")
        if not self.scheduler.is_finished():
            raise RuntimeError("check_logprobs needs an idle engine")
        seq = Sequence(-1, list(token_ids), SamplingParams(), 0, 0, 0, frozenset())
        if not self.block_manager.can_allocate(len(seq)):
            raise ValueError(f"sequence of {len(seq)} tokens does not fit the KV cache")
        self.block_manager.allocate(seq, len(seq))
        try:
            ours = self.runner.score(seq).double().cpu()
        finally:
            self.block_manager.free(seq)
        ref = torch.as_tensor(reference_logprobs, dtype=torch.float64).flatten().cpu()
        if ref.shape != ours.shape:
            raise ValueError(f"reference_logprobs has {ref.numel()} entries, expected {ours.numel()}")
        diff = float((ours - ref).abs().max()) if ours.numel() else 0.0
        if tol is not None and not diff <= tol:
            raise LogprobMismatchError(f"engine log-probs differ from the reference by {diff:.3g} > tol {tol:.3g}")
        return diff

    # ------------------------------------------------------------------ memory
    def release_kv_cache(self) -> None:
        """Free the KV cache and decode graphs so the learner can use the memory."""
        if self.scheduler is not None and not self.scheduler.is_finished():
            raise RuntimeError("cannot release the KV cache while requests are running")
        self.runner.release()

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache takes while allocated."""
        r = self.runner
        return r.num_blocks * KVCache.bytes_per_block(r.num_layers, r.block_size, r.num_kv_heads, r.head_dim, r.dtype,
                                                      self.config.kv_cache_dtype)

    def reallocate_kv_cache(self) -> None:
        """Re-create the KV cache (same number of blocks) and recapture the graphs; an engine
        made with ``kv_cache=False`` sizes its cache now."""
        self.runner.allocate()
        if self.scheduler is None:
            self._schedule_over_cache()

    sleep = release_kv_cache
    wake_up = reallocate_kv_cache
