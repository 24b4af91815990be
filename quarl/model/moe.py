"""Qwen3-MoE's sparse MLP block: a router, top-k routing, and experts run as grouped GEMMs.

Math (transformers' ``Qwen3MoeSparseMoeBlock``): per token, router logits
``x @ gate.weight^T`` in the model's dtype, a softmax over all experts in float32, the
``num_experts_per_tok`` largest probabilities (renormalised to sum to 1 when
``norm_topk_prob``) cast back to the model's dtype, and the sum over the chosen experts of
``p_e * down_e(silu(gate_e(x)) * up_e(x))``. There is no shared expert.

Expert representation: each projection of all experts is one stacked parameter, as
transformers >= 5 holds them: ``experts.gate_up_proj [E, 2I, H]`` (expert ``e``'s gate rows
``[:I]`` above its up rows ``[I:]``) and ``experts.down_proj [E, H, I]``; the router is
``gate.weight [E, H]``. Not a module list of per-expert linears, because:

* the grouped GEMM reads one ``[E, N, K]`` tensor per projection. Per-expert modules would
  need their weights stacked at every forward (a copy of all expert weights per layer and
  step) or a Python loop over the experts;
* it quantizes per expert as it is: every scheme quantizes a ``[N, K]`` weight row by row
  (per channel, or per group of ``G`` along K within a row), so ``quantize_weight`` of the
  ``[E * N, K]`` view is each expert quantized on its own with the scheme's group layout, and
  the packed tensors (codes ``[E * N, K']``, scales ``[E * N, K / G]``) are the stacked
  operands a low-bit grouped kernel reads, one expert a row block (``QuantizedWeight.rows``).
  The one exception is nvfp4's per-tensor scale, which per expert needs one scale per
  ``[N, K]`` block rather than one for the stack;
* the quantizer that swaps ``nn.Linear`` modules by name (``quantize_model``) leaves the
  block alone (its experts are parameters, its router is not an ``nn.Linear``): no
  128 x 48 x 3 linears for it and the engine's fusion to walk, and the router, whose top-k a
  rounding step can flip, stays in the model's dtype, as vLLM and compressed-tensors keep it.
  Quantized experts are a module of their own (the stacked packed tensors, one per
  projection) that replaces :class:`Experts`.

Checkpoints store either layout: the stacked one above (transformers >= 5 with
``save_original_format=False``), or per expert ``experts.{e}.{gate,up,down}_proj.weight``
(released checkpoints, transformers' default ``save_pretrained``, vLLM);
:class:`ExpertLayout` reads both.

The expert computation is grouped: the ``N * k`` (token, expert) pairs are sorted by expert
(a stable sort: pairs of one expert keep their token order) and each projection is one grouped
GEMM over the sorted rows (``torch.nn.functional.grouped_mm``; where it cannot run, one
batched GEMM over the experts' rows padded to the busiest expert's count). Nothing loops over
experts in Python, and nothing syncs with the host on the grouped-GEMM path (the expert
counts stay on the device). The outputs go back to (token, slot) order and are summed over
the k slots: a fixed summation order (no atomics), so a forward gives the same bits on every
run.

Routing replay: a block's ``routing`` attribute (None, or a :class:`MoeRouting`) records the
expert ids each call chose and can impose ids instead of the router's top-k; the gate
weights are then the router's own probabilities of the imposed experts (renormalised as
above), so the router still gets gradients. A token whose imposed ids are ``-1`` (a position
the rollout engine never ran: padding, a response's last token) routes itself.
:func:`moe_routing` installs one on every block for a ``with`` block; the rollout engine keeps
one installed (:func:`install_routing`) to record the experts of every step it runs
(``rollout.routing_replay``, docs/configuration.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from quarl.model.config import TransformerConfig

# recorded expert ids: 2 bytes per (token, slot) and layer; widened to int64 before indexing
ROUTING_ID_DTYPE = torch.int16
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class MoeRouting:
    """The routing of the MoE blocks it is installed on (:func:`moe_routing`).

    replay: ``{layer_idx: expert ids [N, k]}`` (any integer dtype): the experts the layer's
        tokens use instead of the router's top-k, in the order of the forward's flattened
        tokens (``N = B * T`` of a batch, padding included). Layers not listed route themselves,
        and so do the tokens of a row holding a ``-1`` (unknown: never run by the engine).
    record: keep what each layer did in ``expert_ids`` / ``router_ids``.
    expert_ids: ``{layer_idx: [N, k] int16}`` the experts each layer's last call used.
    router_ids: ``{layer_idx: [N, k] int16}`` the router's own top-k of that call (the same
        tensor as ``expert_ids`` where the layer was not replayed), to measure how often a
        replayed route agrees with the one the router would pick.
    """

    replay: dict[int, torch.Tensor] | None = None
    record: bool = True
    expert_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    router_ids: dict[int, torch.Tensor] = field(default_factory=dict)


@contextlib.contextmanager
def moe_routing(model: nn.Module, replay: dict[int, torch.Tensor] | None = None,
                record: bool = True) -> Iterator[MoeRouting]:
    """Install one :class:`MoeRouting` on every :class:`SparseMoeBlock` of ``model`` for the
    block, and put back what each had at exit (None, or an engine's recording). A backward that
    recomputes layers (activation checkpointing) must run inside the block too, or a replayed
    layer would be recomputed with the router's own experts."""
    routing = MoeRouting(replay=replay, record=record)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    before = [block.routing for block in blocks]
    for block in blocks:
        block.routing = routing
    try:
        yield routing
    finally:
        for block, previous in zip(blocks, before):
            block.routing = previous


def install_routing(model: nn.Module, routing: MoeRouting | None) -> None:
    """Set every :class:`SparseMoeBlock`'s ``routing`` of ``model`` (None: remove it); for a
    holder that keeps one across calls (the rollout engine, whose CUDA graphs capture the
    recording)."""
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            block.routing = routing


def moe_layer_ids(model: nn.Module) -> list[int]:
    """The layer indices of ``model``'s :class:`SparseMoeBlock` s, in order (empty: a dense model)."""
    return sorted(m.layer_idx for m in model.modules() if isinstance(m, SparseMoeBlock))


def stacked_routes(routing: MoeRouting, layers: list[int]) -> torch.Tensor:
    """The recorded ``expert_ids`` of ``layers`` (the last call of each) as one ``[N, len(layers), k]``
    int16 tensor: a token's experts in every MoE layer, the layout the engine stores per position."""
    return torch.stack([routing.expert_ids[i] for i in layers], dim=1)


def replay_of(routes: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """``routes [..., len(layers), k]`` (a batch's tokens, any leading shape, in the forward's
    token order; ``-1`` unknown) as :attr:`MoeRouting.replay`: ``{layer: [N, k]}``."""
    flat = routes.reshape(-1, *routes.shape[-2:])
    return {layer: flat[:, j] for j, layer in enumerate(layers)}


class Router(nn.Module):
    """The router: ``weight [E, H]``, logits ``x @ weight^T`` in ``x``'s dtype. Not an
    ``nn.Linear``, so that the linear quantizer leaves it in the model's dtype (module docstring)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, H]`` -> logits ``[N, E]``."""
        return F.linear(x, self.weight)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype,
          expert_ids: torch.Tensor | None = None,
          fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate weights of the chosen experts from router ``logits [N, E]``.

    Returns ``(weights [N, k] in dtype, expert ids [N, k] int64, router top-k [N, k] int64)``:
    softmax in float32, the ``top_k`` largest probabilities, descending, equal ones by expert
    id (a stable sort: deterministic where ``torch.topk``'s order of ties is not); with
    ``expert_ids`` those experts' probabilities instead, so the router's gradient flows through them; a row with a
    negative id, ``-1`` for unknown, takes the router's own top-k), divided by their sum when
    ``norm_topk_prob``. No host sync either way. ``fused`` (the engine's own forward, no
    gradients): on a GPU without ``expert_ids``, the one-launch kernel
    (:func:`~quarl.quant.kernels.moe_route.route_topk`: the same experts, the weights up to the
    softmax's last bits)."""
    if fused and expert_ids is None and logits.is_cuda:
        from quarl.quant.kernels import triton_available

        if triton_available():
            from quarl.quant.kernels.moe_route import MAX_EXPERTS, route_topk

            if logits.shape[-1] <= MAX_EXPERTS:
                weights, ids = route_topk(logits, top_k, norm_topk_prob, dtype)
                return weights, ids, ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    # the k largest, equal probabilities (equal bf16 logits: frequent) in expert order, the rule the
    # fused kernel follows too (torch.topk leaves the order of ties unspecified)
    top_p, top_ids = (t[:, :top_k] for t in torch.sort(probs, dim=-1, descending=True, stable=True))
    if expert_ids is None:
        p, ids = top_p, top_ids
    else:
        if tuple(expert_ids.shape) != tuple(top_ids.shape):
            raise ValueError(f"replayed expert ids have shape {tuple(expert_ids.shape)}; the layer routes "
                             f"{tuple(top_ids.shape)} (tokens, top-k)")
        given = expert_ids.to(device=logits.device, dtype=torch.long)
        ids = torch.where((given >= 0).all(dim=-1, keepdim=True), given, top_ids)
        p = probs.gather(1, ids)
    if norm_topk_prob:
        p = p / p.sum(dim=-1, keepdim=True)
    return p.to(dtype), ids, top_ids


class Experts(nn.Module):
    """All experts of one MoE block, stacked (module docstring): ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``.

    ``lora``: None, or the experts' LoRA adapters (:class:`quarl.model.lora.ExpertsLoRA`,
    attached by ``add_lora`` with the ``experts`` target): while enabled, each projection's
    output gains its adapter's ``scaling * B[e] (A[e] x)``, two more grouped GEMMs over the
    same expert-sorted rows (``GroupedLoRA.add_to``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        self.lora = None  # a plain attribute until an adapter module is assigned

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x ``[N, H]``, expert_ids ``[N, k]`` (int64), weights ``[N, k]`` (x's dtype) -> ``[N, H]``:
        ``sum_j weights[:, j] * expert_{ids[:, j]}(x)`` (each expert's projections with their
        LoRA updates, if adapted)."""
        lora = getattr(self, "lora", None)
        params = {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}
        return run_experts(x, expert_ids, weights, self.num_experts, self.intermediate_size,
                           lambda rows, name, offsets: grouped_linear(rows, params[name], offsets),
                           lora if lora is not None and lora.enabled else None)


def run_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                intermediate_size: int, project: Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor],
                lora=None, slot_order: bool = False) -> torch.Tensor:
    """The expert computation over any weights: x ``[N, H]``, expert_ids ``[N, k]``, weights
    ``[N, k]`` -> ``[N, H]``. ``project(rows, name, offsets)`` runs projection ``name``
    (``gate_up_proj`` / ``down_proj``) of all experts on rows sorted by expert (the stacked
    bf16 weights here, the low-bit ones in :mod:`quarl.quant.experts`); ``lora``: the
    experts' enabled adapters (:class:`quarl.model.lora.ExpertsLoRA`), or None.
    ``slot_order``: the sum over the k slots as k elementwise adds in float32, slot 0 first,
    rounded once (exact mode: the same order whatever N; torch's reduction may pick its
    order by the tensor's size)."""
    n, k = expert_ids.shape
    order, offsets = sort_by_expert(expert_ids, num_experts)
    # each token's row once per slot, then in expert order; both steps have a deterministic
    # backward (a sum over the k copies, a permutation), unlike indexing x by token
    rows = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, x.shape[-1])[order]
    gate_up = project(rows, "gate_up_proj", offsets)
    if lora is not None:
        gate_up = lora.gate_up_proj.add_to(gate_up, rows, offsets)
    gate, up = gate_up.split(intermediate_size, dim=-1)
    hidden = F.silu(gate) * up
    out = project(hidden, "down_proj", offsets)
    if lora is not None:
        out = lora.down_proj.add_to(out, hidden, offsets)
    # back to (token, slot) order (one scatter of the rows: a permutation), then each slot's gate
    # weight; the sum over the slots runs in a fixed order
    per_slot = torch.empty_like(out).index_copy_(0, order, out).view(n, k, out.shape[-1])
    per_slot = per_slot * weights.unsqueeze(-1)
    if not slot_order:
        return per_slot.sum(dim=1)
    total = per_slot[:, 0].float()
    for j in range(1, k):
        total = total + per_slot[:, j].float()
    return total.to(out.dtype)


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``expert_ids [N, k]`` in expert order.

    Returns ``order [N * k]`` (int64 indices into the flattened pairs, stable: the pairs of
    one expert keep their token order) and ``offsets [E]`` (int32, the end of each expert's
    rows in that order, as grouped GEMMs take them). Counted by a scatter rather than
    ``bincount``, whose output size would be read back from the device. On a GPU, up to
    :data:`~quarl.quant.kernels.moe_sort.MAX_PAIRS` pairs (decode steps), one counting kernel
    gives the same order and offsets (:func:`~quarl.quant.kernels.moe_sort.expert_order`)."""
    flat = expert_ids.reshape(-1)
    if flat.is_cuda:
        from quarl.quant.kernels import triton_available

        if triton_available():
            from quarl.quant.kernels.moe_sort import MAX_PAIRS, expert_order

            if flat.numel() <= MAX_PAIRS:
                return expert_order(flat, num_experts)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, counts.cumsum(0, dtype=torch.int32)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (rows sorted by group) times each group's ``weight[g] [N, K]`` transposed
    -> ``[M, N]``; group ``g`` owns rows ``offsets[g-1]:offsets[g]`` (``offsets [G]`` int32).

    One grouped GEMM (``F.grouped_mm``) where torch has it for these operands (float32 /
    bfloat16 / float16, rows of a multiple of 16 bytes); otherwise :func:`padded_grouped_linear`."""
    if _GROUPED_MM is not None and _grouped_mm_fits(x, weight):
        return _GROUPED_MM(x, weight.transpose(1, 2), offs=offsets)
    return padded_grouped_linear(x, weight, offsets)


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes these operands: its kernels need 16-byte aligned row
    strides, and on CUDA (its documented kernels) bfloat16."""
    if x.dtype not in _GROUPED_MM_DTYPES or weight.dtype != x.dtype or x.device != weight.device:
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    aligned = (x.shape[-1] * x.element_size()) % 16 == 0
    return aligned and x.is_contiguous() and weight.is_contiguous()


def padded_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_linear` as one batched GEMM: each group's rows copied into a ``[G, C, K]``
    block padded to the largest group's count ``C`` (read back from the device: a host sync,
    which costs nothing on the CPU, where this path runs), multiplied by ``weight^T``, and
    the real rows gathered back. For operands the grouped GEMM does not take."""
    g, m = weight.shape[0], x.shape[0]
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    group = torch.repeat_interleave(torch.arange(g, device=x.device), counts, output_size=m)
    slot = torch.arange(m, device=x.device) - (offsets.long() - counts)[group]
    # the busiest group's count, read back from the device; inside a CUDA graph capture (the
    # engine's decode graphs, small M) no read-back is allowed: room for every row in each group
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    capacity = m if capturing else (int(counts.max()) if m else 0)
    padded = x.new_zeros(g, capacity, x.shape[-1])
    padded = padded.index_put((group, slot), x)
    return torch.bmm(padded, weight.transpose(1, 2))[group, slot]


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's MLP (module docstring): ``gate`` (:class:`Router`) and ``experts``
    (:class:`Experts`); ``forward(x [B, T, H]) -> [B, T, H]``. ``routing``: a
    :class:`MoeRouting` that records or replays this layer's expert choices (None: neither)."""

    def __init__(self, cfg: TransformerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts)
        self.routing: MoeRouting | None = None  # a plain attribute: never in checkpoints

    def forward(self, x: torch.Tensor, fused_route: bool = False) -> torch.Tensor:
        """``fused_route``: the engine's forward (:func:`route`'s ``fused``)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.route_tokens(self.gate(flat), x.dtype, fused_route)
        return self.experts(flat, ids, weights).view(shape)

    def route_tokens(self, logits: torch.Tensor, dtype: torch.dtype,
                     fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [N, k] in dtype, expert ids [N, k])`` of the router ``logits [N, E]``
        (:func:`route`), the experts replayed and recorded as ``routing`` says."""
        routing = self.routing
        given = routing.replay.get(self.layer_idx) if routing is not None and routing.replay else None
        weights, ids, own = route(logits, self.top_k, self.norm_topk_prob, dtype, given, fused)
        if routing is not None and routing.record:
            used = ids.to(ROUTING_ID_DTYPE)
            routing.expert_ids[self.layer_idx] = used
            routing.router_ids[self.layer_idx] = used if given is None else own.to(ROUTING_ID_DTYPE)
        return weights, ids


class ExpertLayout:
    """The names under which a checkpoint holds the experts of each MoE layer, and the
    stacking of per-expert tensors into the model's parameters as they are read.

    ``expected`` maps the model's tensors (HF names, ``model.layers.L.mlp.experts.gate_up_proj``
    ...) to shapes. For each layer whose checkpoint has per-expert tensors
    (``model.layers.L.mlp.experts.0.gate_proj.weight`` ...) :attr:`expected` names those
    instead; :meth:`take` turns what is read into the model's tensors: other tensors as they
    are, an expert's ``gate``/``up``/``down`` copied into its slot of the layer's stacked
    parameter, which is handed over once all its experts are in (one layer's experts held at
    a time when the shards list them layer by layer)."""

    _PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}

    def __init__(self, checkpoint_keys: Iterable[str], expected: dict[str, tuple[int, ...]]) -> None:
        keys = set(checkpoint_keys)
        self.expected: dict[str, tuple[int, ...]] = {}
        self._pieces: dict[str, tuple[str, int, int]] = {}  # checkpoint name -> (stacked name, expert, row block)
        self._stacked_shapes: dict[str, tuple[int, ...]] = {}
        self._piece_counts: dict[str, int] = {}  # stacked name -> how many checkpoint tensors fill it
        for name, shape in expected.items():
            prefix, _, proj = name.rpartition(".")
            per_expert = f"{prefix}.0.{'gate_proj' if proj == 'gate_up_proj' else 'down_proj'}.weight"
            if not prefix.endswith(".mlp.experts") or name in keys or per_expert not in keys:
                self.expected[name] = shape
                continue
            self._stacked_shapes[name] = shape
            n_experts, rows, cols = shape
            for part, (stacked, block) in self._PARTS.items():
                if stacked != proj:
                    continue
                part_rows = rows // 2 if proj == "gate_up_proj" else rows
                for e in range(n_experts):
                    piece = f"{prefix}.{e}.{part}.weight"
                    self.expected[piece] = (part_rows, cols)
                    self._pieces[piece] = (name, e, block * part_rows)
                    self._piece_counts[name] = self._piece_counts.get(name, 0) + 1
        self._filling: dict[str, tuple[torch.Tensor, int]] = {}  # stacked name -> (tensor, pieces left)

    def take(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The model tensors (HF names) complete once checkpoint tensor ``key`` is read."""
        if key not in self._pieces:
            return [(key, tensor)]
        name, expert, row = self._pieces[key]
        if name not in self._filling:
            stacked = torch.empty(self._stacked_shapes[name], dtype=tensor.dtype, device=tensor.device)
            self._filling[name] = (stacked, self._piece_counts[name])
        stacked, left = self._filling[name]
        stacked[expert, row : row + tensor.shape[0]].copy_(tensor)
        if left > 1:
            self._filling[name] = (stacked, left - 1)
            return []
        del self._filling[name]
        return [(name, stacked)]
