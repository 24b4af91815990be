"""The candidates of ``quarl bench sweep`` (pure: no GPU, no triton at import): each kernel
family's default candidate configs at each M, and candidate specs written and read as text
(``[kernel:]values``, see :mod:`quarl.bench.sweep`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from quarl.quant.kernels.config import FragConfig, TileConfig, TileKConfig, WgConfig

if TYPE_CHECKING:
    from quarl.quant.kernels.dispatch import Plan


class ActQuantConfig(NamedTuple):
    """The activation quantizer's launch (``dispatch.overrides(act_quant=...)``)."""

    block: int  # columns per block: one pass when block >= K
    warps: int


# kernel name -> the config type its Plan carries (None: the kernel takes no config)
KERNEL_CONFIGS: dict[str, type | None] = {
    "wgmma": WgConfig, "tile": TileKConfig, "frag": FragConfig, "swap": TileConfig, "tiled": TileConfig,
    "dequant": None, "pointer": TileConfig, "tma": TileConfig, "cublas": None, "w4a8": TileConfig,
    "gated": TileConfig, "act_quant": ActQuantConfig,
}

Candidate = Any  # a Plan, or an ActQuantConfig for the act-quant family


def _plan(kernel: str, config=None) -> Plan:
    # dispatch imports the Triton kernels: imported here, on first use, so that building the
    # CLI's parser (the families and their docs) works on a machine without triton
    from quarl.quant.kernels.dispatch import Plan

    return Plan(kernel, config)
M_DEFAULT_W4 = (8, 16, 32, 64)


@dataclass(frozen=True)
class Family:
    """A sweepable kernel family: which dispatch table it overrides, with which kernels,
    on which operands, and its default candidates at each M."""

    table: str  # key of dispatch.overrides: a dispatch.TABLES family or "act_quant"
    kernels: tuple[str, ...]  # kernels a spec may name; the first is the default
    format: str  # scheme of the weights (act-quant: of the activations)
    operands: str  # "weight_only" | "quantized_input" | "gated" | "act_quant"
    ms: tuple[int, ...]
    candidates: Callable[[int], list[Candidate]] = field(repr=False)
    doc: str = ""


def _tiles(kernel: str, rows: list[tuple], **fixed) -> list[Plan]:
    """Plans of ``kernel`` from ``(bm, bn, bk, warps, stages, waves[, split_k])`` rows."""
    out = []
    for bm, bn, bk, w, st, wv, *sk in rows:
        out.append(_plan(kernel, TileConfig(bm, bn, bk, split_k=sk[0] if sk else 0, num_warps=w, num_stages=st,
                                           waves=wv, **fixed)))
    return out


def _prescaled_tma(nwg: int, st: int, cl: bool, bps: float = 1.0, minb: int = 1, **kw) -> Plan:
    """The pre-scaled loop fed by TMA copies (the tables' plan at 65-1024 rows), with a producer
    warpgroup wherever one fits (2-3 computing warpgroups, one block a SM, no cluster; docs/kernels.md)."""
    cfg = WgConfig(nwg, st, bps, minb=minb, tail=True, cluster=cl, prescale=True, tma=True, **kw)
    return _plan("wgmma", cfg._replace(producer=cfg.producer_fits()))


def _mbar_tma() -> list[Plan]:
    """The single-tile loop with per-slot mbarriers fed by TMA copies (the tables' at 33-128 rows
    on Hopper): 1-3 warpgroups, 1-2 blocks a SM, with and without the cluster split."""
    return [_plan("wgmma", WgConfig(nwg, st, float(bps), True, minb, tail=True, cluster=cl, mbar=True, tma=True))
            for nwg, st, bps, minb in ((1, 4, 1, 1), (1, 4, 2, 2), (2, 4, 1, 1), (3, 5, 1, 1)) for cl in (False, True)]


def _wgmma(m: int) -> list[Plan]:
    """The wgmma kernel (docs/kernels.md): 1-3 warpgroups, 3-6 ring slots, 1-4 blocks per SM,
    with and without the cluster split; M > 64 (128-token tiles) single-tile shapes only. Above
    16 rows also the pre-scaled loop (``prescale``: one fp32 tile, wgmmas back to back; with TMA
    copies, :func:`_prescaled_tma`), 1-3 warpgroups of 4-5 slots (64 tokens) or 1-4 of 3-4
    (128 tokens: 36-44 KB a slot); above 32 rows the TMA single-tile loop (:func:`_mbar_tma`)."""
    shapes = [(1, 3, False, 1), (1, 4, False, 1), (2, 3, False, 1), (2, 4, False, 1), (2, 6, False, 1),
              (1, 3, True, 4), (3, 4, True, 1)]
    pre = [(1, 4, 2), (1, 5, 2), (2, 4, 1), (2, 5, 1), (3, 4, 1)]
    if m > 64:  # 128 tokens: one fp32 tile only, 36-41 KB a ring slot
        shapes = [(1, 3, True, 2), (1, 4, True, 1), (2, 3, True, 1), (2, 4, True, 1), (3, 3, True, 1)]
        pre = [(1, 4, 1), (2, 3, 1), (2, 4, 1), (3, 3, 1), (3, 4, 1), (4, 4, 1)]
    plans = [_plan("wgmma", WgConfig(nwg, st, float(bps), single, minb, tail=True, cluster=cl))
             for nwg, st, single, minb in shapes for bps in (1, 2, 4) for cl in (False, True)]
    if m > 16:
        plans += [_prescaled_tma(nwg, st, cl, float(bps), minb)
                  for nwg, st, minb in pre for bps in (1, 2) for cl in (False, True)]
    if m > 32:
        plans += _mbar_tma()
    return plans


def _tile(m: int) -> list[Plan]:
    """The block-tiled CUDA kernel (docs/kernels.md): (slabs, NT, MT, WM, stages) by M bucket."""
    by_m = {
        16: [(4, 4, 1, 1, 4), (4, 4, 1, 1, 6), (4, 8, 1, 1, 4), (8, 4, 1, 1, 4), (2, 4, 1, 1, 6)],
        32: [(4, 4, 2, 1, 4), (4, 4, 2, 1, 6), (2, 4, 2, 1, 6), (8, 4, 2, 1, 4)],
        64: [(4, 4, 4, 1, 4), (4, 4, 4, 1, 5), (2, 4, 4, 1, 6), (4, 4, 2, 2, 4), (4, 4, 2, 2, 5), (2, 4, 2, 2, 6),
             (4, 8, 2, 2, 4)],
    }
    rows = by_m[16 if m <= 16 else 32 if m <= 32 else 64]
    return [_plan("tile", TileKConfig(*c, float(bps))) for c in rows for bps in (1, 2, 4)]


def _frag(m: int) -> list[Plan]:
    """The CUDA fragment kernel (M <= 16): warps x ring slots x blocks per SM."""
    return [_plan("frag", FragConfig(nw=nw, blocks_per_sm=float(bps), stages=st))
            for nw in (1, 2, 4, 8) for st in (2, 4, 8) if nw * st <= 32 for bps in (2, 4, 8)]


def _swap(m: int) -> list[Plan]:
    """The Triton swap kernel (docs/kernels.md) and dequantize + cuBLAS."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    return [_plan("swap", TileConfig(bm, bn, num_warps=w, num_stages=st, waves=wv))
            for bn, w in ((64, 4), (128, 8)) for st in (3, 4) for wv in (0, 0.5, 1, 2, 4, 8)] + [_plan("dequant")]


def _mid(m: int) -> list[Plan]:
    """Above 64 rows: the wgmma kernel's pre-scaled loop fed by TMA copies (:func:`_prescaled_tma`)
    in 128-token tiles (1-4 warpgroups, 3-4 slots, K split in clusters or not) and, past 128
    rows, in 192- and 256-token tiles (two warpgroups, 4 and 3 slots of a group, or 8 and 6 of
    half a group); up to 128 rows the TMA single-tile loop (:func:`_mbar_tma`); the swap kernel
    at large tiles (a per-chunk partial scaled into the accumulator: two tiles of accumulators,
    so at most 64 fp32 each a thread); and dequantize + cuBLAS."""
    swaps = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (256, 64, 8)]
    pre = [_prescaled_tma(nwg, st, cl)
           for nwg, st in ((1, 4), (2, 3), (2, 4), (3, 3), (3, 4), (4, 4)) for cl in (False, True)]
    if m <= 128:
        pre += _mbar_tma()
    if m > 128:
        pre += [_prescaled_tma(2, st, cl, tile=tile, halves=hv)
                for tile, st, hv in ((192, 4, False), (256, 3, False), (192, 8, True), (256, 6, True))
                for cl in (False, True)]
    return pre + [_plan("swap", TileConfig(bm, bn, num_warps=w, num_stages=st))
                  for bm, bn, w in swaps if bm <= max(64, m) for st in (3, 4) if bm * st < 1024] + [_plan("dequant")]


def _weight_only(m: int) -> list[Plan]:
    """``wo_gemm_kernel`` tiles of the other weight-only formats, and dequantize + cuBLAS."""
    return [_plan("tiled", TileConfig(bm, bn, num_stages=st, post_scale=ps))
            for bm in (16, 32, 64) if bm >= min(m, 64) for bn in (32, 64, 128) for st in (3, 4)
            for ps in (True, False)] + [_plan("dequant")]


# W8A8 TMA tiles (docs/kernels.md, "W8A8"): (bm, bn, bk, warps, stages, programs per SM[, K splits])
_TMA = [(128, 128, 128, 8, 4, 1), (128, 256, 128, 8, 3, 1), (128, 128, 128, 4, 4, 1), (64, 128, 128, 4, 4, 2),
        (64, 64, 128, 4, 5, 3), (128, 64, 128, 4, 4, 2), (256, 128, 128, 8, 3, 1), (128, 128, 256, 8, 3, 1)]
_TMA_SPLIT = [(128, 128, 128, 8, 4, 1, 2), (128, 128, 128, 8, 4, 1, 3), (128, 128, 128, 8, 4, 1, 4),
              (128, 128, 128, 4, 4, 1, 2), (64, 128, 128, 4, 4, 2, 2), (128, 64, 128, 4, 4, 2, 2),
              (128, 256, 128, 8, 3, 1, 4)]
_TMA_TAIL = [(128, 128, 128, 8, 4, 1, -1), (128, 256, 128, 8, 3, 1, -1), (128, 128, 128, 4, 4, 1, -1),
             (64, 128, 128, 4, 4, 2, -1), (128, 64, 128, 4, 4, 2, -1)]
_POINTER = [(16, 64, 256, 4, 3, 0), (64, 64, 128, 4, 4, 0), (64, 128, 128, 4, 4, 0, 1), (128, 128, 128, 8, 3, 0, 1),
            (128, 128, 128, 8, 3, 0, 2), (128, 128, 128, 8, 3, 0, 4)]


def _w8a8(cublas: bool) -> Callable[[int], list[Plan]]:
    def candidates(m: int) -> list[Plan]:
        out = [_plan("cublas")] if cublas else []
        out += _tiles("pointer", [r for r in _POINTER if m > 16 or r[0] == 16])
        out += _tiles("tma", [r for r in _TMA if m > 64 or r[0] <= 64])
        if 128 <= m <= 512:  # too few 128 x 128 tiles to fill the GPU: split K
            out += _tiles("tma", _TMA_SPLIT)
        if m >= 256:  # whole tiles for the full waves, the last partial wave split along K
            out += _tiles("tma", _TMA_TAIL)
        return out

    return candidates


def _w4a8(m: int) -> list[Plan]:
    return [_plan("w4a8", TileConfig(bm, bn, split_k=sk, num_warps=w))
            for bm, bn, w in ((16, 64, 4), (16, 128, 4), (32, 128, 4), (64, 64, 4), (64, 128, 4), (128, 128, 8))
            if bm <= max(16, 2 * m) for sk in (0, 1)]


def _gated(m: int) -> list[Plan]:
    """Gated W8A8 tiles (docs/kernels.md, "Gated gate/up")."""
    rows = [(64, 64, 128, 4, 4, 2), (64, 64, 128, 4, 3, 3), (64, 32, 128, 4, 4, 3), (64, 32, 128, 4, 6, 3),
            (64, 64, 64, 4, 6, 2), (64, 64, 128, 8, 4, 2), (64, 128, 128, 8, 3, 1), (128, 64, 128, 8, 3, 1),
            (128, 128, 128, 8, 3, 1)]
    return _tiles("gated", rows)


def _act_quant(m: int) -> list[ActQuantConfig]:
    """Columns per block x warps (docs/kernels.md): one pass up to the row, or several blocks."""
    return [ActQuantConfig(b, w) for b, w in ((1024, 2), (1024, 4), (2048, 4), (4096, 4), (4096, 16), (8192, 8),
                                              (8192, 16), (32768, 32))]


FAMILIES: dict[str, Family] = {
    "wgmma": Family("w4a16", ("wgmma",), "w4a16", "weight_only", (64, 16, 32, 8, 128), _wgmma,
                    "int4 g128 weight-only, Hopper wgmma kernel (W4A16 rows on sm90)"),
    "tile": Family("w4a16", ("tile",), "w4a16", "weight_only", (8, 16, 32, 48, 64), _tile,
                   "int4 g128 weight-only, block-tiled CUDA kernel (sm80 / sm89, 4 < M <= 8)"),
    "frag": Family("w4a16", ("frag",), "w4a16", "weight_only", (1, 4, 8, 16), _frag,
                   "int4 g128 weight-only, CUDA fragment kernel (sm80 / sm89, M <= 4)"),
    "swap": Family("w4a16", ("swap", "dequant"), "w4a16", "weight_only", (16, 32, 64), _swap,
                   "int4 g128 weight-only, Triton swap kernel and dequantize + cuBLAS (no wgmma)"),
    "mid": Family("w4a16", ("wgmma", "swap", "dequant"), "w4a16", "weight_only", (128, 256, 1024, 4096), _mid,
                  "int4 g128 weight-only above 64 rows: the wgmma kernel's pre-scaled loop (Hopper), the Triton "
                  "swap kernel at large tiles, dequantize + cuBLAS"),
    "weight-only": Family("weight_only", ("tiled", "dequant"), "nvfp4", "weight_only", (16, 32, 64, 128), _weight_only,
                          "other weight-only formats (--format nvfp4, mxfp4, w2a16): wo_gemm_kernel tiles"),
    "fp8": Family("fp8", ("tma", "pointer", "cublas"), "w8a8-fp8", "quantized_input", (64, 256, 1024, 4096),
                  _w8a8(True), "W8A8 fp8 GEMM on per-token codes: TMA / pointer Triton tiles and _scaled_mm"),
    "int8": Family("int8", ("tma", "pointer"), "w8a8-int8", "quantized_input", (64, 256, 1024, 4096), _w8a8(False),
                   "W8A8 int8 GEMM on per-token codes: TMA / pointer Triton tiles"),
    "w4a8": Family("w4a8", ("w4a8",), "w4a8-int8", "quantized_input", (16, 64, 256), _w4a8,
                   "W4A8 GEMM on int8 codes"),
    "gated-fp8": Family("gated_fp8", ("gated",), "w8a8-fp8", "gated", (17, 32, 64, 128, 256, 512), _gated,
                        "fp8 gate/up GEMM with SiLU-and-mul in its epilogue + down's quantizer, vs the plain path"),
    "gated-int8": Family("gated_int8", ("gated",), "w8a8-int8", "gated", (17, 32, 64, 128, 256, 512), _gated,
                         "int8 gate/up GEMM with SiLU-and-mul in its epilogue + down's quantizer, vs the plain path"),
    "act-quant": Family("act_quant", ("act_quant",), "w8a8-fp8", "act_quant", (64, 256, 1024, 4096), _act_quant,
                        "per-token activation quantizer (--format w8a8-fp8 / w8a8-int8) at each distinct K"),
}


# ---------------------------------------------------------------- candidate specs (pure)

def _parse_value(text: str, kind: str, where: str) -> Any:
    try:
        if kind == "bool":
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        return int(text) if kind == "int" else float(text)
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not a {kind}") from None


def _type_name(t: Any) -> str:
    """``int`` / ``float`` / ``bool`` of an annotation (a type, a string, or a ForwardRef)."""
    name = getattr(t, "__forward_arg__", None) or getattr(t, "__name__", None) or str(t)
    if name not in ("int", "float", "bool"):
        raise TypeError(f"config field annotated {t!r}: the spec parser reads int, float and bool")
    return name


def _expand(fam_name: str, kernel: str, body: str, item: str) -> list[Candidate]:
    cls = KERNEL_CONFIGS[kernel]
    where = f"sweep {fam_name}: candidate {item!r}"
    if cls is None:
        if body:
            raise ValueError(f"{where}: kernel {kernel} takes no config")
        return [_plan(kernel)]
    fields = cls._fields
    kinds = {f: _type_name(t) for f, t in cls.__annotations__.items()}
    given: dict[str, list[Any]] = {}
    positional = True
    for i, part in enumerate(p.strip() for p in body.split(",") if p.strip()):
        if "=" in part:
            name, text = (s.strip() for s in part.split("=", 1))
            positional = False
        elif not positional:
            raise ValueError(f"{where}: a positional value after a field=value one")
        elif i >= len(fields):
            raise ValueError(f"{where}: {cls.__name__} has {len(fields)} fields ({', '.join(fields)})")
        else:
            name, text = fields[i], part
        if name not in fields:
            raise ValueError(f"{where}: unknown field {name!r}; {cls.__name__} fields: {', '.join(fields)}")
        if name in given:
            raise ValueError(f"{where}: field {name!r} given twice")
        given[name] = [_parse_value(v.strip(), kinds[name], f"{where}, field {name}") for v in text.split("|")]
    missing = [f for f in fields if f not in cls._field_defaults and f not in given]
    if missing:
        raise ValueError(f"{where}: {cls.__name__} needs {', '.join(missing)} (fields: {', '.join(fields)})")
    names = list(given)
    configs = [cls(**dict(zip(names, combo))) for combo in itertools.product(*(given[n] for n in names))]
    return configs if kernel == "act_quant" else [_plan(kernel, c) for c in configs]


def parse_candidates(fam_name: str, spec: str) -> list[Candidate]:
    """Candidates of family ``fam_name`` from a spec (see the module docstring); ``#`` starts a
    comment. Raises ValueError naming the family, the item and the valid kernels / fields."""
    fam = family(fam_name)
    out: list[Candidate] = []
    for line in spec.splitlines():
        for item in line.split("#", 1)[0].split(";"):
            item = item.strip()
            if not item:
                continue
            kernel, body = item.split(":", 1) if ":" in item else (fam.kernels[0], item)
            kernel, body = kernel.strip(), body.strip()
            if kernel not in fam.kernels:
                raise ValueError(f"sweep {fam_name}: candidate {item!r}: kernel {kernel!r} is not one of this family's "
                                 f"({', '.join(fam.kernels)})")
            out += _expand(fam_name, kernel, body, item)
    if not out:
        raise ValueError(f"sweep {fam_name}: no candidates in {spec!r}")
    return out


def format_candidate(c: Candidate) -> str:
    """The spec of one candidate (``parse_candidates`` reads it back): the kernel and the
    fields that differ from their defaults (required fields always)."""
    if isinstance(c, ActQuantConfig):
        return f"act_quant:{c.block},{c.warps}"
    if c.config is None:
        return f"{c.kernel}:"
    cfg = c.config
    parts = [f"{f}={_fmt(v)}" for f, v in zip(cfg._fields, cfg)
             if f not in cfg._field_defaults or cfg._field_defaults[f] != v]
    return f"{c.kernel}:{','.join(parts)}"


def _fmt(v: Any) -> str:
    return str(int(v)) if isinstance(v, bool) else repr(v)


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown sweep family {name!r}; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def parse_shapes(spec: str, model: str) -> list[tuple[str, int, int]]:
    """``(label, N, K)`` of a comma list of shape sets of ``model`` (``engine``, ``modules``)
    and/or ``NxK`` items."""
    from quarl.bench.gemm import MODELS, SHAPE_SETS, linear_shapes

    out: list[tuple[str, int, int]] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in SHAPE_SETS:
            out += [(s.label, s.n, s.k) for s in linear_shapes(MODELS[model], (item,))]
        elif "x" in item and all(p.isdigit() for p in item.split("x", 1)):
            n, k = (int(p) for p in item.split("x", 1))
            out.append((item, n, k))
        else:
            raise ValueError(f"--shapes: {item!r} is neither a shape set ({', '.join(SHAPE_SETS)}) nor NxK")
    seen, unique = set(), []
    for s in out:
        if (s[1], s[2]) not in seen:
            seen.add((s[1], s[2]))
            unique.append(s)
    return unique


def family_shapes(fam: Family, shapes: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The shapes a family runs on: the gated GEMM only on [gate; up] weights (the engine's
    fused gate_up, or NxK items), the quantizer once per distinct K (N unused)."""
    if fam.operands == "gated":
        return [s for s in shapes if "gate_up" in s[0] or s[0][0].isdigit()]
    if fam.operands == "act_quant":
        ks = sorted({k for _, _, k in shapes})
        return [(f"K={k}", 0, k) for k in ks]
    return shapes
