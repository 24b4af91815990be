"""The fragment-ordered copies of an int4 g128 weight that the CUDA w4 kernels read, and
:class:`RepackCache`, the object a module owns to keep them.

Layout ("frag"), built by :func:`repack_w4` from the canonical packed weight
(:mod:`quarl.quant.reference`). N is padded to a multiple of 64 (a "slab"), Kp to 128. For
slab ``s`` and 16-column step ``kk`` there are 512 bytes; lane ``L`` (``g = L // 4``, ``t = L %
4``) owns bytes ``16 L .. 16 L + 15``, four little-endian 32-bit words ``w_i``. Word ``i``
feeds the 8-column tiles ``j = 2 i + h`` (h = 0, 1); its nibble ``p`` (bits ``4p .. 4p+3``) is
the code of weight ``W[64 s + 8 j + g, 16 kk + k]`` with ``h = (p >> 1) & 1`` and ``k = 2 t +
(p >= 4) + 8 (p & 1)``. A 16-bit mask of ``w >> 4q`` then yields the bf16x2 register of
fragment half ``q & 1`` of tile ``2 i + (q >> 1)``. Scales are stored transposed, ``[Kp / 128,
Np]`` fp32; asymmetric zero points as the bf16x2 bit pattern of ``-(128 + z)``, ``[Kp / 128,
Np]`` uint32. The "wgmma" layout holds the same words in the order the wgmma kernel's warps
unpack them (:func:`wgmma_words`); "wgmma-gated" is the wgmma layout of a ``[gate; up]``
weight's rows reordered for the gated epilogue (:func:`gated_rows`).

Pure torch (any device): imported by the modules that own a cache without importing triton.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, NamedTuple

import torch

from quarl.quant import reference as ref
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import PACK_K

SLAB = 64  # output columns per warp (fragment kernel) / per slab
LAYOUTS = ("frag", "wgmma", "wgmma-gated")


class FragWeight(NamedTuple):
    """The fragment-ordered copy of a w4 g128 weight (see the module docstring)."""

    qdata: torch.Tensor  # 32-bit words (int32 storage) [Np / 64, Kp / 16, 32, 4]
    scales: torch.Tensor  # fp32 [Kp / 128, Np]
    negz: torch.Tensor | None  # 32-bit patterns (int32 storage) [Kp / 128, Np], asymmetric only


@functools.cache
def _lane_maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, k) offsets ``[32 lanes, 4 words, 8 nibbles]`` inside a 64 x 16 (slab x step) tile
    (made once per device: every publish repacks each weight with them, and a copy to the
    GPU per call is a host sync)."""
    lane = torch.arange(32).view(32, 1, 1)
    i = torch.arange(4).view(1, 4, 1)
    p = torch.arange(8).view(1, 1, 8)
    g, t = lane // 4, lane % 4
    j = 2 * i + ((p >> 1) & 1)
    n = 8 * j + g
    k = 2 * t + (p >= 4).long() + 8 * (p & 1)
    return n.expand(32, 4, 8).to(device), k.expand(32, 4, 8).to(device)


def _as_u32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the same bits as a 32-bit tensor (int32 storage)."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def repack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, Kp]`` (< 16, Kp % 128 == 0) -> fragment words ``[Np/64, Kp/16, 32, 4]``
    (32-bit patterns stored as int32)."""
    n, kp = codes.shape
    np_ = -(-n // SLAB) * SLAB
    c = torch.zeros(np_, kp, dtype=torch.uint8, device=codes.device)
    c[:n] = codes
    tiles = c.view(np_ // SLAB, SLAB, kp // 16, 16).permute(0, 2, 1, 3)  # [S, KS, 64, 16]
    nmap, kmap = _lane_maps(codes.device)
    nib = tiles[:, :, nmap, kmap]  # [S, KS, 32, 4, 8] uint8
    # nibbles 2b and 2b + 1 make byte b; the four bytes, little-endian, are the word (one byte
    # per weight at most in flight, instead of int64 shifts and sums)
    pairs = (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous()  # [S, KS, 32, 4, 4]
    return pairs.view(torch.int32).squeeze(-1)


def unpack_frag_codes(frag: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`repack_codes` (tests): fragment words -> uint8 codes ``[N, Kp]``."""
    s, ks = frag.shape[0], frag.shape[1]
    words = frag.to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * torch.arange(8, device=frag.device).view(1, 1, 1, 1, 8)
    nib = (words.unsqueeze(-1) >> shifts) & 0xF  # [S, KS, 32, 4, 8]
    nmap, kmap = _lane_maps(frag.device)
    tiles = torch.zeros(s, ks, SLAB, 16, dtype=torch.int64, device=frag.device)
    tiles[:, :, nmap, kmap] = nib
    return tiles.permute(0, 2, 1, 3).reshape(s * SLAB, ks * 16)[:n].to(torch.uint8)


def wgmma_words(frag: torch.Tensor) -> torch.Tensor:
    """Fragment words ``[S, KS, 32 lanes, 4]`` -> the wgmma kernel's order ``[S, KS / 8, 4
    warps, 2 halves, 32 lanes, 4]``: the same words, those warp ``w`` of a warpgroup unpacks
    (word ``w`` of each lane: rows ``16 w + g`` and ``16 w + 8 + g`` of the slab, the wgmma A
    fragment of that warp) brought together, four steps (``4 h .. 4 h + 3``) per 16 bytes."""
    s, ks = frag.shape[:2]
    return frag.reshape(s, ks // 8, 2, 4, 32, 4).permute(0, 1, 5, 2, 4, 3).contiguous()


def unwgmma_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`wgmma_words`."""
    s, groups = words.shape[:2]
    return words.permute(0, 1, 3, 5, 4, 2).reshape(s, groups * 8, 32, 4).contiguous()


def gated_rows(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The row order of a ``[gate; up]`` weight of ``n = 2 I`` rows (``I % 8 == 0``) in the
    "wgmma-gated" layout: each 16-row group holds 8 gate rows, then the same 8 rows of up, so
    that the wgmma kernel's thread that holds a gate row's sums (row ``16 w + g`` of a warp)
    also holds its up row's (``16 w + 8 + g``) and can write ``silu(gate) * up`` itself."""
    if n % 16:
        raise ValueError(f"a gated [gate; up] weight needs 2 I rows with I % 8 == 0, got {n} rows")
    p = torch.arange(n, device=device)
    return torch.where(p % 16 < 8, (p // 16) * 8 + p % 16, n // 2 + (p // 16) * 8 + p % 16 - 8)


def repack_w4(qw: QuantizedWeight, layout: str = "frag") -> FragWeight:
    """The ``layout`` copy of an int4 g128 ``QuantizedWeight``: "frag", "wgmma", or
    "wgmma-gated" (the wgmma layout of the rows in :func:`gated_rows` order)."""
    if not (qw.scheme.weight_format == "int" and qw.scheme.weight_bits == 4 and qw.scheme.group_size == PACK_K):
        raise ValueError(f"fragment layout needs int4 weights with group 128, got {qw.scheme.name}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown w4 layout {layout!r}; one of {LAYOUTS}")
    n = qw.shape[0]
    np_ = -(-n // SLAB) * SLAB
    codes, qscales, qzeros = ref.unpack_4bit(qw.qdata), qw.scales, qw.zeros
    if layout == "wgmma-gated":
        order = gated_rows(n, qw.device)
        codes, qscales = codes[order], qscales[order]
        qzeros = None if qzeros is None else qzeros[order]
    frag = repack_codes(codes)
    if layout != "frag":
        frag = wgmma_words(frag)
    scales = torch.zeros(qscales.shape[1], np_, dtype=torch.float32, device=qw.device)
    scales[:, :n] = qscales.t()
    negz = None
    if qzeros is not None:
        bits = (0xC300 | qzeros.to(torch.int64)) * 0x10001  # bf16x2 of -(128 + z), both halves
        nz = torch.full((qzeros.shape[1], np_), 0xC308C308, dtype=torch.int64, device=qw.device)
        nz[:, :n] = bits.t()
        negz = _as_u32(nz)
    return FragWeight(frag, scales, negz)


def _versions(qw: QuantizedWeight) -> tuple:
    return tuple(None if t is None else t._version for t in (qw.qdata, qw.scales, qw.zeros))


class _Entry(NamedTuple):
    source: weakref.ref  # the qdata tensor the copy was made from
    versions: tuple
    copy: FragWeight


class RepackCache:
    """The repacked copies of one weight, per layout, owned by the module that owns the weight
    (``QuantLinear``, ``QATLinear``, the engine's fused projections).

    A copy is made at first use and rebuilt when the weight's tensors changed (a different
    ``qdata`` tensor, or a new version of one of them). A rebuild writes into the old copy's
    storage when the shapes agree, so CUDA graphs captured over it see the new weights; it
    cannot run inside capture. After an in-place load, call :meth:`refresh` eagerly."""

    def __init__(self, keep_dequantized: bool = False, dense: bool = False) -> None:
        self._entries: dict[str, _Entry] = {}
        self._makers: dict[str, Callable] = {}  # how each dense copy is made (for refresh)
        self.keep_dequantized = keep_dequantized
        self.dense = dense

    # copies of the owning module start empty: the layouts are rebuilt from its weight at first use
    def __getstate__(self) -> dict:
        return {"_entries": {}, "_makers": {}, "keep_dequantized": self.keep_dequantized, "dense": self.dense}

    def __deepcopy__(self, memo) -> "RepackCache":
        return RepackCache(self.keep_dequantized, self.dense)

    def dequantized(self, qw: QuantizedWeight, dtype: torch.dtype,
                    make: Callable[[QuantizedWeight, torch.dtype], torch.Tensor]) -> torch.Tensor:
        """``make(qw, dtype)``: the weight ``[N, K]`` dequantized.

        - ``dense`` (the engine's ``rollout.dense_weights``): one copy at a fixed address,
          rebuilt in place when the weight changes (CUDA graphs captured over it see the new
          values), so that plain GEMMs on it cost what bf16's do;
        - ``keep_dequantized`` (the learner's ``QATLinear``): kept per weight version (at
          training batch sizes its forward and backward run on it, made once per optimizer
          step instead of twice per micro-batch) and dropped at :meth:`drop_dequantized`;
        - neither: made per call (the engine's weights stay low-bit in memory)."""
        if self.dense:
            return self._dense(qw, dtype, make)
        if not self.keep_dequantized:
            return make(qw, dtype)
        layout = f"dequant-{dtype}"
        e = self._entries.get(layout)
        if e is not None and self._matches(e, qw):
            return e.copy
        w = make(qw, dtype)
        self._entries[layout] = _Entry(weakref.ref(qw.qdata), _versions(qw), w)
        return w

    def _dense(self, qw: QuantizedWeight, dtype: torch.dtype,
               make: Callable[[QuantizedWeight, torch.dtype], torch.Tensor]) -> torch.Tensor:
        layout = f"dense-{dtype}"
        e = self._entries.get(layout)
        if e is not None and self._matches(e, qw):
            return e.copy
        if qw.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the dense weight copy is first needed (or stale) inside CUDA-graph capture; "
                               "run the same forward eagerly once before capturing")
        with torch.inference_mode(False), torch.no_grad():
            w = make(qw, dtype)
            if e is not None and e.copy.shape == w.shape and e.copy.device == w.device:
                w = e.copy.copy_(w)
        self._entries[layout] = _Entry(weakref.ref(qw.qdata), _versions(qw), w)
        self._makers[layout] = make
        return w

    def drop_dequantized(self) -> None:
        """Free the dequantized copies (the learner's phase is over; they go stale at the next
        step). Dense copies stay: CUDA graphs hold their addresses."""
        for layout in [k for k in self._entries if k.startswith("dequant-")]:
            del self._entries[layout]

    def _matches(self, e: _Entry, qw: QuantizedWeight) -> bool:
        return e.source() is qw.qdata and e.versions == _versions(qw)

    def get(self, qw: QuantizedWeight, layout: str = "frag") -> FragWeight:
        e = self._entries.get(layout)
        if e is not None and self._matches(e, qw):
            return e.copy
        if qw.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the w4 {layout} layout is first needed (or stale) inside CUDA-graph capture; "
                               "run the same forward eagerly once before capturing")
        # normal tensors even when first built under inference_mode (the engine generates in
        # it), so that later in-place loads outside it can refresh them
        with torch.inference_mode(False), torch.no_grad():
            fresh = repack_w4(qw, layout)
            if e is not None and all((a is None) == (b is None)
                                     and (a is None or (a.shape == b.shape and a.device == b.device))
                                     for a, b in zip(e.copy, fresh)):
                for a, b in zip(e.copy, fresh):
                    if a is not None:
                        a.copy_(b)
                fresh = e.copy
        self._entries[layout] = _Entry(weakref.ref(qw.qdata), _versions(qw), fresh)
        return fresh

    def layouts(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def is_fresh(self, qw: QuantizedWeight) -> bool:
        """No copy, or only ones made from ``qw``'s current contents."""
        return all(self._matches(e, qw) for e in self._entries.values())

    def refresh(self, qw: QuantizedWeight, rows: tuple[int, int] | None = None) -> None:
        """Rebuild the copies that exist (after an in-place write into ``qw``).

        With ``rows = (start, stop)`` only the 64-row slabs covering those output rows are
        repacked (a fused q/k/v weight loading one of its parts); the caller guarantees the
        rest of each copy was fresh before the write."""
        self.drop_dequantized()  # remade from the new codes at next use
        for layout, e in list(self._entries.items()):
            if layout.startswith("dense-"):
                self._refresh_dense(layout, e, qw, rows)
                continue
            if rows is None or e.source() is not qw.qdata or layout == "wgmma-gated":  # (its slabs mix rows)
                self.get(qw, layout)
                continue
            s0, s1 = rows[0] // SLAB, -(-rows[1] // SLAB)
            a, b = s0 * SLAB, min(s1 * SLAB, qw.shape[0])
            sub = qw.rows(a, b)
            fw = e.copy
            with torch.inference_mode(False), torch.no_grad():
                part = repack_w4(sub, layout)
                fw.qdata[s0:s1].copy_(part.qdata)
                fw.scales[:, a:b].copy_(part.scales[:, : b - a])
                if fw.negz is not None:
                    fw.negz[:, a:b].copy_(part.negz[:, : b - a])
            self._entries[layout] = _Entry(e.source, _versions(qw), fw)

    def _refresh_dense(self, layout: str, e: _Entry, qw: QuantizedWeight, rows: tuple[int, int] | None) -> None:
        """Rewrite a dense copy in place: whole, or only output rows ``rows`` (each row's
        groups are its own, so a row block dequantizes alone)."""
        make, dtype = self._makers[layout], e.copy.dtype
        if rows is None or e.source() is not qw.qdata:
            self._dense(qw, dtype, make)
            return
        a, b = rows
        with torch.inference_mode(False), torch.no_grad():
            e.copy[a:b].copy_(make(qw.rows(a, b), dtype))
        self._entries[layout] = _Entry(e.source, _versions(qw), e.copy)
