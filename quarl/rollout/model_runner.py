"""GPU state of the engine: KV cache, step inputs, CUDA graphs of the decode step, sampling."""

from __future__ import annotations

import gc
from typing import NamedTuple

import numpy as np
import torch

from quarl.model.moe import MoeRouting, install_routing, moe_layer_ids, stacked_routes
from quarl.model.transformer import TORCH_OPS, Transformer
from quarl.quant.kernels.device import dependent_launches
from quarl.rollout.attention import PagedAttention, StepContext
from quarl.rollout.config import EngineConfig
from quarl.rollout.dense_weights import dense_bytes, dense_weight_plan
from quarl.rollout.kv_cache import KVCache
from quarl.rollout.sampler import Sampler, SamplingBatch, row_seeds
from quarl.rollout.sequence import Sequence

_CPU_DEFAULT_BLOCKS = 512


def _graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def _check_fp8_kv_support(kv_cache_dtype: str, device: torch.device, backend: str) -> None:
    """The Triton kernels convert to and from e4m3 in hardware, which needs sm89+ (Ada, Hopper)."""
    if kv_cache_dtype != "fp8" or device.type != "cuda" or backend != "triton":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"kv_cache_dtype=fp8 needs a GPU with fp8 conversions (compute capability 8.9+, e.g. L4/L40/H100); "
            f"this one is {major}.{minor}: use kv_cache_dtype=auto"
        )


_QUEUE_AHEAD_CYCLES = 1_000_000  # ~0.6 ms of GPU clock
_L2_FLUSH_BYTES = 64 << 20  # more than the L2 of the GPUs we tune on (H100 / H200: 50 MB)
def decode_splits(programs: int, sms: int, per_sm: int, max_model_len: int) -> int:
    """Context splits of the decode kernel for ``programs`` (sequence, kv head) pairs: at most
    ``per_sm`` programs per SM in all, so that they run in one wave when that many fit on an
    SM (rounding up instead left a second, partial wave: 640 programs where 528 fit, at batch
    64 on an H100), and at least one split; at most 16, and none shorter than 128 tokens."""
    return int(max(1, min(per_sm * sms // programs, 16, -(-max_model_len // 128))))


class DecodeHandle(NamedTuple):
    """A launched decode step: its row count and the host slot its outputs land in."""

    rows: int
    slot: int


class ModelRunner:
    """Runs prefill and decode steps of the model over the paged cache and samples.

    Decode on GPU replays a CUDA graph captured for the smallest batch size that
    holds the batch (rows beyond the batch write the cache's scratch block); the graph
    reads its inputs from static buffers, so a step costs a few host-to-device copies,
    one replay, the sampling kernel and one device-to-host copy of the sampled tokens.

    Exact mode (``model.exact``, :mod:`quarl.quant.kernels.invariant_model`): every step runs the
    learner's batch-invariant kernels (no fused kernels, no decode tuning), CUDA graphs as before.

    ``record_routes`` (an MoE model): every step also keeps the experts each token it ran
    used in each MoE layer, ``[tokens, moe layers, k]`` int16: a prefill's in
    :attr:`prefill_routes`, a decode step's from :meth:`decode_routes`. A :class:`MoeRouting`
    stays installed on the model's blocks, so the decode graphs are captured recording: their
    stacked expert ids are one more static output, copied to a host slot beside the sampled
    tokens right after each replay (before the next step's replay can overwrite it). A dense
    model, or ``record_routes`` off, records nothing and costs nothing.
    """

    def __init__(self, model: Transformer, config: EngineConfig, max_model_len: int, allocate: bool = True,
                 record_routes: bool = False) -> None:
        self.model = model
        self.moe_layers = moe_layer_ids(model) if record_routes else []
        self.routing = MoeRouting(record=True) if self.moe_layers else None
        self.route_k = model.config.num_experts_per_tok
        if self.routing is not None:
            install_routing(model, self.routing)
        self.prefill_routes: np.ndarray | None = None  # [tokens of the last prefill's leaders, moe layers, k]
        self.config = config
        self.max_model_len = max_model_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.is_cuda = self.device.type == "cuda"
        mc = model.config
        self.num_layers, self.num_kv_heads, self.head_dim = mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim
        backend = config.attention_backend
        self.backend = ("triton" if self.is_cuda else "torch") if backend == "auto" else backend
        _check_fp8_kv_support(config.kv_cache_dtype, self.device, self.backend)
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        model.rotary.ensure(max_model_len)
        model.rotary.auto_grow = False
        # (BLOCK_N, num_warps, programs per SM, kernel) of decode attention; kernel "cuda": the
        # fp8 cache's CUDA kernel (quarl.rollout.fp8_decode), BLOCK_N its tokens per tile
        self.decode_tiling: tuple[int, int, int, str] = (64, 4, 4, "triton")
        self.decode_tuning_ms = 0.0
        self.decode_tuning_table: dict[str, float] = {}  # "BLOCK_Nxwarpsxper_smxkernel" -> median ms
        self.fused = False
        self.exact = getattr(model, "exact", None)
        self.ops = TORCH_OPS  # the steps of the model's forward (Transformer.hidden_states)
        if self.exact is not None:
            from quarl.quant.kernels.invariant_model import exact_engine_ops

            self.ops = exact_engine_ops(model, self.device)
        elif self.backend == "triton" and config.fused_kernels:
            from quarl.rollout.fused import FUSED_OPS, fuse_projections, supports_fused

            self.fused = supports_fused(model)
            if self.fused:
                fuse_projections(model)
                self.ops = FUSED_OPS
        self.sampler = Sampler(mc.vocab_size, self.device, self.backend == "triton", config.top_p_candidates,
                               exact=self.exact is not None)
        self.dense_weight_bytes = self._plan_dense_weights()
        self.num_blocks: int | None = None  # (sized by the first allocate())
        self.kv: KVCache | None = None
        # batch size -> (graph, logits, context splits, stacked expert ids [bs, moe layers, k] or None)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, int, torch.Tensor | None]] = {}
        if allocate:
            self.allocate()

    # ---------------------------------------------------------------- memory
    def _plan_dense_weights(self) -> int:
        """Marks the weight-only quantized GEMMs to keep a dense copy of their weight
        (``EngineConfig.dense_weights``, :func:`~quarl.rollout.dense_weights.dense_weight_plan`);
        returns the bytes those copies will take (0: none)."""
        total = torch.cuda.get_device_properties(self.device).total_memory if self.is_cuda else 0
        chosen = dense_weight_plan(self.config.dense_weights, self.model, self.dtype.itemsize, total,
                                   exact=self.exact is not None)
        for cache, _ in chosen:
            cache.dense = True
        return dense_bytes(chosen, self.dtype.itemsize)

    def _new_cache(self, num_blocks: int) -> KVCache:
        return KVCache(
            self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.device,
            self.config.kv_cache_dtype,
        )

    def _num_kv_blocks(self) -> int:
        cap = self.config.num_kv_blocks
        if not self.is_cuda:
            return cap or _CPU_DEFAULT_BLOCKS
        per_block = KVCache.bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.config.kv_cache_dtype
        )
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self._warmup_prefill()
        peak_extra = torch.cuda.max_memory_allocated() - base
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        # Sampler scratch (top-k path in float32) and graph outputs, beyond the warm-up.
        vocab = self.model.config.vocab_size
        reserve = 4 * self.config.max_num_seqs * vocab * 4 + (256 << 20)
        budget = total * self.config.gpu_memory_utilization - used - peak_extra - reserve
        blocks = int(budget // per_block)
        if cap:
            blocks = min(blocks, cap)
        need = -(-self.max_model_len // self.block_size)
        if blocks < need:
            gib = 2**30
            others = max(0, used - torch.cuda.memory_reserved())  # (this process's CUDA context counts here too)
            raise RuntimeError(
                f"KV cache too small: {blocks} blocks fit in memory, one sequence of max_model_len "
                f"{self.max_model_len} needs {need}; raise gpu_memory_utilization or lower max_model_len. The GPU "
                f"holds {total / gib:.1f} GiB, {used / gib:.1f} GiB in use, {others / gib:.1f} GiB of it outside this "
                f"process's tensors (other processes on this GPU take from the same budget)"
            )
        return blocks

    @torch.inference_mode()
    def _warmup_prefill(self) -> None:
        """Run the largest prefill once on a scratch cache to measure activation memory."""
        tokens = self.config.max_num_batched_tokens
        lens = []
        while sum(lens) < tokens and len(lens) < self.config.max_num_seqs:
            lens.append(min(self.max_model_len, tokens - sum(lens)))
        blocks = sum(-(-n // self.block_size) for n in lens)
        self.kv = self._new_cache(blocks)
        vocab = self.model.config.vocab_size
        seqs, next_block = [], 0
        for n in lens:
            nb = -(-n // self.block_size)
            ids = torch.randint(0, vocab, (n,)).tolist()
            seq = Sequence(-1, ids, None, 0, 0, 0, frozenset())  # type: ignore[arg-type]
            seq.block_table = list(range(next_block, next_block + nb))
            next_block += nb
            seqs.append(seq)
        self._prefill_logits(seqs)
        torch.cuda.synchronize()
        self.kv = None
        gc.collect()

    def allocate(self) -> None:
        """(Re)create the KV cache and, on GPU, capture the decode graphs; the first call sizes
        the cache from the memory free then (:meth:`_num_kv_blocks`)."""
        if self.kv is not None:
            return
        if self.num_blocks is None:
            self.num_blocks = self._num_kv_blocks()  # (its warm-up prefill makes the dense copies)
            self._make_decode_buffers(min(self.config.max_num_seqs, 256))
        self.kv = self._new_cache(self.num_blocks)
        if self.is_cuda and self.backend == "triton" and self.config.tune_decode and self.decode_tuning_ms == 0.0 \
                and self.exact is None:
            self.tune_decode()
        if self.is_cuda and self.config.cuda_graphs:
            self.capture_graphs()

    def release(self) -> None:
        """Free the KV cache and the graphs (they point into it); weights stay."""
        self.graphs.clear()
        self._graph_pool = None
        self.kv = None
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------- inputs
    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _block_table_array(self, seqs: list[Sequence], width: int) -> np.ndarray:
        table = np.zeros((len(seqs), width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            table[i, : len(seq.block_table)] = seq.block_table
        return table

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        blocks = np.asarray(seq.block_table, dtype=np.int64)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def _num_splits(self, batch: int, programs_per_sm: int | None = None) -> int:
        """Context splits of the decode kernel (:func:`decode_splits`)."""
        if self.backend != "triton":
            return 1
        per_sm = programs_per_sm or self.decode_tiling[2]
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.is_cuda else 8
        return decode_splits(batch * self.num_kv_heads, sms, per_sm, self.max_model_len)

    def _split_len(self, max_context: int, splits: int) -> int:
        per = -(-max_context // splits)
        return -(-per // 128) * 128

    @torch.inference_mode()
    def tune_decode(self) -> None:
        """Time decode-attention tilings (BLOCK_N, warps, programs per SM, kernel) on random K/V
        in this cache at the largest batch, over the run's context lengths; keep the fastest.
        An fp8 cache also tries the CUDA kernel where it runs (:mod:`quarl.rollout.fp8_decode`)."""
        from quarl.rollout import fp8_decode, kernels

        batch = min(self.config.max_num_seqs, self._bs_cap)
        # The run's context length (up to 4k, and what the cache holds at this batch), the
        # sequences' lengths spread over it as a rollout's contexts grow: a tiling that wins
        # at 1k can lose at 4k (fp8 K/V: 128-token tiles with 8 splits, 4k, batch 64).
        nb = min(-(-min(self.max_model_len, 4096) // self.block_size), self.num_blocks // batch)
        if nb < 2:
            return
        ctx_len = nb * self.block_size
        k_cache, v_cache = self.kv.k[0], self.kv.v[0]
        kv_scales = (self.kv.k_scale[0], self.kv.v_scale[0])
        for cache in (k_cache, v_cache):  # normal_ has no float8 kernel: draw, then cast
            cache[: batch * nb] = torch.randn(cache[: batch * nb].shape, device=self.device).to(cache.dtype)
        for scales in kv_scales if self.kv.quantized else ():
            scales[: batch * nb].fill_(2.0**-9)  # a power of two, as quarl.quant.kv's scales
        tables = torch.randperm(batch * nb, device=self.device).view(batch, nb).to(torch.int32)
        hq = self.model.config.num_attention_heads
        q = torch.randn(batch, hq, self.head_dim, device=self.device, dtype=self.dtype)
        lens = torch.randint(max(1, ctx_len // 8), ctx_len + 1, (batch,), device=self.device, dtype=torch.int32)
        out = torch.empty_like(q)
        candidates = [(block_n, warps, per_sm, "triton") for per_sm in (2, 4, 8)
                      for block_n, warps in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8))]
        if fp8_decode.supported(q, k_cache, kv_scales):  # ~150 registers a thread: 3 blocks of 4 warps per SM
            candidates += [(16, 4, 2, "cuda"), (16, 4, 3, "cuda"), (16, 8, 1, "cuda"), (32, 4, 2, "cuda")]
        calls = {}
        for block_n, warps, per_sm, kernel in candidates:
            splits = self._num_splits(batch, per_sm)
            split_len = torch.tensor([self._split_len(ctx_len, splits)], device=self.device, dtype=torch.int32)
            po = torch.empty(batch, hq, splits, self.head_dim, device=self.device)
            pl = torch.empty(batch, hq, splits, device=self.device)

            def call(block_n=block_n, warps=warps, kernel=kernel, splits=splits, split_len=split_len, po=po, pl=pl):
                kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, split_len, out, po, pl, splits,
                                               self.head_dim**-0.5, block_n, warps, kv_scales=kv_scales, kernel=kernel)
            call()  # compile
            calls[(block_n, warps, per_sm, kernel)] = call
        torch.cuda.synchronize()
        # Rounds over all candidates, median per candidate: the best few tilings are within a
        # few % of each other, so a single timing each would pick among them at random. Each call starts
        # with L2 flushed, as in a decode step, where the weights pass through L2 between two
        # layers' attention: warm, the split partials of a many-split tiling stay in L2 and its
        # reduction looks cheaper than it is in the step.
        flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=self.device)
        times: dict[tuple, list[float]] = {c: [] for c in calls}
        for _ in range(9):
            for cand, call in calls.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                flush.zero_()
                # the GPU waits while the host queues the launches: the time is the kernels',
                # not Triton's Python launcher's (~0.1 ms, more than a 1k-context kernel)
                torch.cuda._sleep(_QUEUE_AHEAD_CYCLES)
                start.record()
                call()
                end.record()
                end.synchronize()
                times[cand].append(start.elapsed_time(end))
        del flush
        medians = {cand: sorted(t)[len(t) // 2] for cand, t in times.items()}
        self.decode_tuning_table = {"x".join(map(str, c)): round(m, 5)
                                    for c, m in sorted(medians.items(), key=lambda i: i[1])}
        best = min((m, cand) for cand, m in medians.items())
        self.decode_tiling = best[1]
        self.decode_tuning_ms = best[0]
        self.kv.zero_()

    def _hidden_states(self, ids: torch.Tensor, pos: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        return self.model.hidden_states(ids, pos, attn, self.ops)

    # ---------------------------------------------------------------- prefill
    @torch.inference_mode()
    def _prefill_logits(
        self, seqs: list[Sequence], all_positions: bool = False, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run every token of ``seqs`` (their blocks allocated); logits of the last
        token of each ``[S, V]``, or of every token ``[N, V]`` when ``all_positions``.

        ``rows`` repeats last-token hidden states before the LM head (the ``n`` samples of
        a shared prompt): the head then runs on as many rows as without sharing, so both
        give the same bits (a GEMM's rounding can depend on its row count)."""
        lens = [len(s) for s in seqs]
        cu = np.zeros(len(seqs) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(lens)
        ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=int(cu[-1]))
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        slots = np.concatenate([self._slots(s, 0, len(s)) for s in seqs])
        width = max(len(s.block_table) for s in seqs)
        ctx = StepContext(
            is_prefill=True,
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(self._block_table_array(seqs, width)),
            context_lens=self._tensor(np.asarray(lens, dtype=np.int32)),
            cu_seqlens_q=self._tensor(cu),
            max_seqlen_q=max(lens),
            host_context_lens=lens,
            host_cu_seqlens_q=cu.tolist(),
        )
        attn = PagedAttention(self.kv, ctx, self.backend, self.exact is not None)
        hidden = self._hidden_states(self._tensor(ids)[None], self._tensor(positions)[None], attn)[0]
        if not all_positions:
            hidden = hidden[torch.from_numpy(cu[1:] - 1).to(self.device).long()]
            if rows is not None:
                hidden = hidden.index_select(0, rows)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.exact is not None:
            from quarl.quant.kernels.invariant_model import exact_logits

            return exact_logits(self.model, hidden)
        return self.model.logits(hidden)

    # ---------------------------------------------------------------- decode
    def _make_decode_buffers(self, max_bs: int) -> None:
        """Static decode inputs: one int64 buffer (ids, positions, slots, context lengths,
        row seeds, split length; the two lengths as int32) filled on the host and sent with
        one copy, and the block tables, updated row by row only where a sequence changed."""
        dev = self.device
        pin = self.is_cuda
        self._bs_cap = max_bs
        self._host_ints = torch.zeros(5 * max_bs + 1, dtype=torch.int64, pin_memory=pin)
        self._dev_ints = torch.zeros(5 * max_bs + 1, dtype=torch.int64, device=dev)
        h, d = self._host_ints.numpy(), self._dev_ints
        self._h_ids, self._h_pos, self._h_slots, _, self._h_seed = (h[i * max_bs : (i + 1) * max_bs] for i in range(5))
        self._d_ids, self._d_pos, self._d_slots, _, self._d_seed = (d[i * max_bs : (i + 1) * max_bs] for i in range(5))
        # the context lengths and the split length are int32, as the attention kernels read
        # them (int64 made every layer's decode kernel convert both): the first half of
        # their int64 words, so one copy still sends every input
        self._h_ctx = h[3 * max_bs : 4 * max_bs].view(np.int32)[:max_bs]
        self._d_ctx = d[3 * max_bs : 4 * max_bs].view(torch.int32)[:max_bs]
        self._h_split = h[5 * max_bs :].view(np.int32)[:1]
        self._d_split = d[5 * max_bs :].view(torch.int32)[:1]
        self._host_tables = torch.full((max_bs, self.max_blocks_per_seq), self.num_blocks, dtype=torch.int32,
                                       pin_memory=pin)
        self._h_tables = self._host_tables.numpy()
        self._d_tables = torch.full((max_bs, self.max_blocks_per_seq), self.num_blocks, dtype=torch.int32, device=dev)
        self._d_cu = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)  # (exact mode's decode attention)
        self._row_owner: list[tuple[int, int] | None] = [None] * max_bs  # (seq_id, table epoch) per row
        self._row_len = [0] * max_bs
        # two host slots for the sampled tokens and log-probs: a step queued behind the one
        # being collected writes the other (steps alternate)
        self._host_out = torch.zeros(2, 2, max_bs, dtype=torch.float64, pin_memory=pin)
        # and, recording routes, each step's expert ids ([rows, moe layers, k]) beside them
        self._host_routes = torch.full((2, max_bs, len(self.moe_layers), self.route_k), -1, dtype=torch.int16,
                                       pin_memory=pin) if self.routing is not None else None
        self._out_slot = 0
        self._dev_tokens = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self._dev_logprobs = torch.zeros(max_bs, dtype=torch.float32, device=dev)
        # recorded each decode step: its inputs left the host buffers / its outputs reached
        # their host slot
        self._inputs_sent = torch.cuda.Event() if self.is_cuda else None
        self._outputs_ready = [torch.cuda.Event(), torch.cuda.Event()] if self.is_cuda else None

    def _decode_context(self, n: int, splits: int, host_lens: list[int] | None = None) -> StepContext:
        return StepContext(
            host_context_lens=host_lens,
            is_prefill=False,
            slot_mapping=self._d_slots[:n],
            block_tables=self._d_tables[:n],
            context_lens=self._d_ctx[:n],
            split_len=self._d_split,
            num_splits=splits,
            decode_block_n=self.decode_tiling[0],
            decode_warps=self.decode_tiling[1],
            decode_kernel=self.decode_tiling[3],
            cu_seqlens_q=self._d_cu[: n + 1] if self.exact is not None else None,
        )

    def _fill_decode_inputs(self, seqs: list[Sequence], padded: int, splits: int, keys: np.ndarray, ahead: int) -> int:
        """Write the step's inputs into the host buffers for rows ``[0, padded)``; returns the
        table width. ``ahead = 1``: the step after the one in flight (each sequence one token
        longer than now; the input ids then come from the device, :meth:`launch_decode`)."""
        n, bs = len(seqs), self.block_size
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n) + ahead
        if not ahead:
            self._h_ids[:n] = np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=n)
        self._h_pos[:n] = lens - 1
        last = np.fromiter((s.block_table[(len(s) + ahead - 1) // bs] for s in seqs), dtype=np.int64, count=n)
        self._h_slots[:n] = last * bs + (lens - 1) % bs
        self._h_ctx[:n] = lens
        self._h_seed[:n] = row_seeds(keys, lens)
        self._h_ids[n:padded] = 0
        self._h_pos[n:padded] = 0
        self._h_slots[n:padded] = self.kv.scratch_slot
        self._h_ctx[n:padded] = 1
        self._h_split[0] = self._split_len(int(lens.max()), splits)
        width = 1
        for i, seq in enumerate(seqs):
            table, owner = seq.block_table, (seq.seq_id, seq.table_epoch)
            if self._row_owner[i] != owner:
                self._h_tables[i, : len(table)] = table
                self._row_owner[i] = owner
            elif self._row_len[i] != len(table):
                start = self._row_len[i]
                self._h_tables[i, start : len(table)] = table[start:]
            self._row_len[i] = len(table)
            width = max(width, len(table))
        for i in range(n, padded):
            self._h_tables[i, 0] = self.num_blocks  # padded rows read the scratch block
            self._row_owner[i] = None
        return width

    def prepare_decode(self, seqs: list[Sequence], block_copies: list[tuple[int, int]], ahead: int = 0) -> None:
        """Plan a decode step of ``seqs``: its copy-on-write block copies go on the stream
        and its inputs into the host buffers. ``ahead = 1``: it is the step after the one in
        flight, planned while the GPU runs that one (``Scheduler.lookahead``); the host
        buffers are rewritten only once the step in flight has taken its inputs from them."""
        n = len(seqs)
        self.kv.copy_blocks(block_copies)
        if n > self._bs_cap:
            self._make_decode_buffers(n)
        if self.is_cuda:
            self._inputs_sent.synchronize()
        use_graph = bool(self.graphs) and n <= max(self.graphs)
        padded = min(b for b in self.graphs if b >= n) if use_graph else n
        splits = self.graphs[padded][2] if use_graph else self._num_splits(n)
        rows = self.sampler.rows_for(seqs)
        self._fill_decode_inputs(seqs, padded, splits, rows.keys, ahead)
        self._plan = (n, padded, use_graph, splits, rows, bool(ahead))

    @torch.inference_mode()
    def launch_decode(self) -> DecodeHandle:
        """Send the planned step's inputs (planned ahead: the last step's sampled tokens,
        still on the device, are its input ids), run it and sample, without waiting; the
        tokens and log-probs come back with :meth:`collect_decode` of the returned handle.
        A step may be launched while the one before is not collected yet (it queues behind
        it on the stream); at most two are outstanding."""
        n, padded, use_graph, splits, rows, ahead = self._plan
        self._dev_ints.copy_(self._host_ints, non_blocking=True)
        self._d_tables[:padded].copy_(self._host_tables[:padded], non_blocking=True)
        if self.is_cuda:
            self._inputs_sent.record()
        if ahead:
            self._d_ids[:n].copy_(self._dev_tokens[:n])
        if use_graph:
            graph, out, _, routes = self.graphs[padded]
            graph.replay()
            logits = out[:n]
        else:
            host_lens = self._h_ctx[:n].tolist() if self.backend == "torch" else None
            ctx = self._decode_context(n, splits, host_lens)
            logits = self._decode_forward(self._d_ids[:n], self._d_pos[:n], ctx)
            routes = stacked_routes(self.routing, self.moe_layers) if self.routing is not None else None
        tokens, logprobs = self.sampler(
            logits, SamplingBatch(rows, self._d_seed[:n]), out=(self._dev_tokens[:n], self._dev_logprobs[:n])
        )
        slot = self._out_slot
        self._out_slot ^= 1
        host = self._host_out[slot, :, :n]
        host[0].copy_(tokens, non_blocking=True)
        host[1].copy_(logprobs, non_blocking=True)
        if routes is not None:  # (queued before the next replay rewrites a graph's static output)
            self._host_routes[slot, :n].copy_(routes[:n], non_blocking=True)
        if self.is_cuda:
            self._outputs_ready[slot].record()
        return DecodeHandle(n, slot)

    def collect_decode(self, handle: DecodeHandle) -> tuple[list[int], list[float]]:
        """Wait for a launched step; its sampled tokens and log-probs."""
        if self.is_cuda:
            self._outputs_ready[handle.slot].synchronize()
        host = self._host_out[handle.slot, :, : handle.rows]
        return host[0].long().tolist(), host[1].tolist()

    def decode_routes(self, handle: DecodeHandle) -> np.ndarray:
        """The expert ids ``[rows, moe layers, k]`` of a collected step (:meth:`collect_decode`
        first): a view of its host slot, valid until the step after next is launched."""
        return self._host_routes[handle.slot, : handle.rows].numpy()

    def _decode_forward(self, ids: torch.Tensor, pos: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        attn = PagedAttention(self.kv, ctx, self.backend, self.exact is not None)
        with dependent_launches(self.config.dependent_launches):
            hidden = self._hidden_states(ids[:, None], pos[:, None], attn)
        return self._logits(hidden[:, 0])

    def capture_graphs(self) -> None:
        max_bs = min(self.config.max_graph_batch or self.config.max_num_seqs, self.config.max_num_seqs)
        # every batch the scheduler may run fits these buffers: a larger one would remake them
        # and leave the graphs reading the old ones
        self._make_decode_buffers(max(self.config.max_num_seqs, self._bs_cap))
        self._h_ctx[:] = 1
        self._h_slots[:] = self.kv.scratch_slot
        self._h_split[0] = 128
        self._dev_ints.copy_(self._host_ints)
        pool = None
        self.graphs = {}
        with torch.inference_mode():
            for bs in reversed(_graph_batch_sizes(max_bs)):
                splits = self._num_splits(bs)
                ctx = self._decode_context(bs, splits)
                self._decode_forward(self._d_ids[:bs], self._d_pos[:bs], ctx)  # warm-up (compiles kernels)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    out = self._decode_forward(self._d_ids[:bs], self._d_pos[:bs], ctx)
                    # the blocks' recorded ids are the graph's tensors: stacked by it too
                    routes = stacked_routes(self.routing, self.moe_layers) if self.routing is not None else None
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = (graph, out, splits, routes)
        self._graph_pool = pool
        torch.cuda.synchronize()

    # ---------------------------------------------------------------- steps
    def step(
        self, is_prefill: bool, groups: list[list[Sequence]], block_copies: list[tuple[int, int]]
    ) -> tuple[list[int], list[float]]:
        """Run one scheduled step and sample the next token of every group member."""
        assert self.kv is not None, "KV cache released; call reallocate_kv_cache() first"
        if not is_prefill:
            self.prepare_decode([g[0] for g in groups], block_copies)
            return self.collect_decode(self.launch_decode())
        self.kv.copy_blocks(block_copies)
        members = [s for g in groups for s in g]
        rows = None
        if len(members) != len(groups):
            rows = torch.tensor([i for i, g in enumerate(groups) for _ in g], device=self.device)
        with torch.inference_mode():
            logits = self._prefill_logits([g[0] for g in groups], rows=rows)
            if self.routing is not None:
                self.prefill_routes = stacked_routes(self.routing, self.moe_layers).cpu().numpy()
            tokens, logprobs = self.sampler(logits, self.sampler.prepare(members))
        return tokens.tolist(), logprobs.tolist()

    @torch.inference_mode()
    def score(self, seq: Sequence) -> torch.Tensor:
        """log-probs ``[len-1]`` float32 of tokens ``1..`` of ``seq`` (its blocks allocated)."""
        logits = self._prefill_logits([seq], all_positions=True)[:-1]
        targets = torch.tensor(seq.token_ids[1:], device=self.device)
        if self.exact is not None:  # (the learner's log-probs in exact mode: the same kernel)
            from quarl.quant.kernels.invariant_softmax import invariant_token_logprobs

            return invariant_token_logprobs(logits, targets)[0]
        return torch.log_softmax(logits.float(), -1).gather(1, targets[:, None])[:, 0]
