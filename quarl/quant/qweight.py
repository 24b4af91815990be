"""``QuantizedWeight``: the packed tensors of one linear layer, as learner and engine share them."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from quarl.quant import reference as ref
from quarl.quant.scheme import PACK_K, QuantScheme, get_scheme

TENSOR_FIELDS = ("qdata", "scales", "zeros", "global_scale")


@dataclass
class QuantizedWeight:
    """A weight ``[N, K]`` quantized under ``scheme`` (layouts: :mod:`quarl.quant.reference`).

    qdata: codes (int8 / float8_e4m3fn ``[N, K]``, packed uint8 ``[N, Kp * bits / 8]``, or
        the weight itself for ``bf16``).
    scales: per-channel ``[N]`` or per-group ``[N, Kp / G]`` (fp32, e4m3 or e8m0 bytes).
    zeros: uint8 zero points ``[N, Kp / G]`` of asymmetric formats.
    global_scale: fp32 scalar tensor scale of nvfp4.
    """

    scheme: QuantScheme
    shape: tuple[int, int]
    qdata: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by field name (absent ones left out)."""
        return {f: getattr(self, f) for f in TENSOR_FIELDS if getattr(self, f) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` these codes stand for, in ``dtype``."""
        return ref.dequantize_tensors(
            self.scheme, self.shape, self.qdata, self.scales, self.zeros, self.global_scale, dtype
        )

    def codes(self) -> torch.Tensor:
        """One integer code per weight ``[N, K]`` (unpacked; raw bits for float formats)."""
        n, k = self.shape
        if not self.scheme.quantizes_weights:
            int_of_size = {2: torch.int16, 4: torch.int32, 8: torch.int64}
            return self.qdata.contiguous().view(int_of_size[self.qdata.element_size()])
        if self.scheme.packed:
            return ref.unpack_codes(self.qdata, self.scheme.weight_bits)[:, :k]
        return self.qdata.view(torch.uint8) if self.qdata.dtype == torch.float8_e4m3fn else self.qdata

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        moved = {f: t.to(device) for f, t in self.tensors().items()}
        return QuantizedWeight(self.scheme, self.shape, **moved)

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Output rows ``start:stop`` as views (every format keeps its codes, scales and zero
        points per row; a per-tensor scale is shared)."""
        n = self.shape[0]
        views = {f: t[start:stop] if t.dim() and t.shape[0] == n else t for f, t in self.tensors().items()}
        return QuantizedWeight(self.scheme, (stop - start, self.shape[1]), **views)

    def clone(self) -> "QuantizedWeight":
        return QuantizedWeight(self.scheme, self.shape, **{f: t.clone() for f, t in self.tensors().items()})

    def copy_(self, other: "QuantizedWeight") -> "QuantizedWeight":
        """Copy ``other``'s tensors into this one's storage (keeps CUDA-graph addresses valid).
        Copies that kernels derived from these tensors are the owner's to refresh
        (``QuantLinear.load_quantized``)."""
        for t, src in self.copy_pairs(other):
            t.copy_(src)
        return self

    def copy_pairs(self, other: "QuantizedWeight") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(this tensor, other's)`` for each stored tensor, after checking that ``other`` fits
        (what :meth:`copy_` copies; a caller may batch many weights' copies in one call)."""
        if other.scheme != self.scheme or tuple(other.shape) != tuple(self.shape):
            raise ValueError(f"cannot load {other.scheme.name} {other.shape} into {self.scheme.name} {self.shape}")
        mine, theirs = self.tensors(), other.tensors()
        if mine.keys() != theirs.keys():
            raise ValueError(f"tensor sets differ: {sorted(mine)} vs {sorted(theirs)}")
        for f, t in mine.items():
            if t.shape != theirs[f].shape:
                raise ValueError(f"{f}: shape {tuple(theirs[f].shape)} != {tuple(t.shape)}")
        return [(t, theirs[f]) for f, t in mine.items()]


def concat_quantized(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The weights stacked along N, ``[sum N_i, K]``: every stored tensor concatenated by rows
    (codes, per-row or per-group scales, zero points). Formats with a per-tensor scale
    (nvfp4's ``global_scale``) cannot be stacked this way."""
    first = parts[0]
    if any(p.scheme != first.scheme or p.in_features != first.in_features for p in parts):
        raise ValueError("concat_quantized needs one scheme and one in_features for all parts")
    if first.scheme.per_tensor_scale:
        raise ValueError(f"{first.scheme.name} has a per-tensor scale: its weights cannot be stacked by rows")
    tensors = {f: torch.cat([getattr(p, f) for p in parts], 0) for f in first.tensors()}
    return QuantizedWeight(first.scheme, (sum(p.out_features for p in parts), first.in_features), **tensors)


def quantize_weight(w: torch.Tensor, scheme: QuantScheme | str) -> QuantizedWeight:
    """Quantize ``w [N, K]`` with the reference quantizer (runs on w's device)."""
    scheme = get_scheme(scheme)
    with torch.no_grad():
        tensors = ref.quantize_tensors(w, scheme)
    return QuantizedWeight(scheme, (int(w.shape[0]), int(w.shape[1])), **tensors)


def quantize_weights(ws: list[torch.Tensor], scheme: QuantScheme | str,
                     chunk_bytes: int = 1 << 28) -> list[QuantizedWeight]:
    """``[quantize_weight(w, scheme) for w in ws]`` with far fewer launches: weights of one
    input width, dtype and device are stacked by rows (up to ``chunk_bytes`` of input per
    call) and quantized together. Every format scales per row or per group of a row, so the
    stored tensors are the same bit for bit; each result holds row-block views of its call's
    tensors. nvfp4 (a per-tensor scale) is quantized one weight at a time."""
    scheme = get_scheme(scheme)
    out: list[QuantizedWeight | None] = [None] * len(ws)
    if scheme.per_tensor_scale or not scheme.quantizes_weights:
        return [quantize_weight(w, scheme) for w in ws]
    by_kind: dict[tuple, list[int]] = {}
    for i, w in enumerate(ws):
        by_kind.setdefault((w.shape[1], w.dtype, w.device), []).append(i)
    for idx in by_kind.values():
        chunk: list[int] = []
        size = 0
        for j, i in enumerate(idx):
            chunk.append(i)
            size += ws[i].numel() * ws[i].element_size()
            if size >= chunk_bytes or j == len(idx) - 1:
                _quantize_stacked([ws[c] for c in chunk], scheme, chunk, out)
                chunk, size = [], 0
    return out  # type: ignore[return-value]


def _quantize_stacked(ws: list[torch.Tensor], scheme: QuantScheme, where: list[int],
                      out: list[QuantizedWeight | None]) -> None:
    with torch.no_grad():
        tensors = ref.quantize_tensors(ws[0].detach() if len(ws) == 1 else torch.cat([w.detach() for w in ws]), scheme)
    row = 0
    for w, i in zip(ws, where):
        n = int(w.shape[0])
        out[i] = QuantizedWeight(scheme, (n, int(w.shape[1])), **{f: t[row : row + n] for f, t in tensors.items()})
        row += n


def stored_layout(
    scheme: QuantScheme, out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the tensors ``quantize_weight`` makes for an ``[N, K]`` weight
    (``dtype`` is the weight's own dtype, used by ``bf16``)."""
    n, k = out_features, in_features
    if not scheme.quantizes_weights:
        return {"qdata": ((n, k), dtype)}
    if not scheme.packed:
        qdt = torch.int8 if scheme.weight_format == "int" else torch.float8_e4m3fn
        return {"qdata": ((n, k), qdt), "scales": ((n,), torch.float32)}
    kp = -(-k // PACK_K) * PACK_K
    ngroups = kp // scheme.group_size
    sdt = {"fp32": torch.float32, "e4m3": torch.float8_e4m3fn, "e8m0": torch.uint8}[scheme.scale_format]
    out = {"qdata": ((n, kp * scheme.weight_bits // 8), torch.uint8), "scales": ((n, ngroups), sdt)}
    if not scheme.symmetric:
        out["zeros"] = ((n, ngroups), torch.uint8)
    if scheme.scale_format == "e4m3":
        out["global_scale"] = ((), torch.float32)
    return out


def empty_quantized(
    scheme: QuantScheme | str, out_features: int, in_features: int,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
) -> QuantizedWeight:
    """Uninitialised storage of the right shapes (what ``QuantLinear`` allocates)."""
    scheme = get_scheme(scheme)
    tensors = {
        f: torch.zeros(shape, dtype=dt, device=device)
        for f, (shape, dt) in stored_layout(scheme, out_features, in_features, dtype).items()
    }
    return QuantizedWeight(scheme, (out_features, in_features), **tensors)


assert {f.name for f in fields(QuantizedWeight)} >= set(TENSOR_FIELDS)
