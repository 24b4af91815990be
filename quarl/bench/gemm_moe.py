"""``quarl bench gemm --moe``: an MoE preset's expert projections (all experts of one
projection on rows sorted by expert) timed per format and method against the floor of
reading every expert: bf16's grouped GEMM, a low-bit format's dequantize + grouped GEMM path
and its grouped kernel (:mod:`quarl.quant.kernels.moe_gemm`)."""

from __future__ import annotations

import datetime
from dataclasses import asdict
from typing import Callable, NamedTuple

import torch

from quarl.bench.common import git_commit
from quarl.bench.gemm import _power_label, _triton_version, save
from quarl.bench.timing import POWER_MODES, Ceilings, PowerGate, measure_ceilings, n_sets, time_per_call
from quarl.model.presets import PRESETS
from quarl.quant.kernels.moe_rules import moe_kernel_supports
from quarl.quant.qweight import quantize_weight
from quarl.quant.scheme import get_scheme

MOE_MODELS = tuple(n for n, c in PRESETS.items() if c.get("num_experts"))
MOE_TOKENS_PER_EXPERT = (4, 8, 32, 128, 1024)  # 4: a decode step of 64 sequences, top-8 of 128
MOE_FORMATS = ("bf16", "w4a16", "w8a8-fp8")
MOE_METHODS = ("grouped_mm", "dequant", "kernel")  # bf16's grouped GEMM; a low-bit format's two paths


class MoeShape(NamedTuple):
    label: str
    e: int
    n: int
    k: int


def moe_shapes(model: str) -> list[MoeShape]:
    """The expert projections of MoE preset ``model``: gate_up ``[E, 2 I, H]``, down ``[E, H, I]``."""
    c = PRESETS[model]
    if not c.get("num_experts"):
        raise ValueError(f"{model} is not an MoE preset; MoE presets: {', '.join(MOE_MODELS)}")
    e, h, i = c["num_experts"], c["hidden_size"], c["moe_intermediate_size"]
    return [MoeShape("gate_up_proj", e, 2 * i, h), MoeShape("down_proj", e, h, i)]


def moe_methods(fmt: str) -> tuple[str, ...]:
    """How format ``fmt``'s experts are timed: bf16 by its grouped GEMM; a low-bit format by the
    dequantize + grouped GEMM path, and by the grouped kernel where that runs the scheme."""
    sc = get_scheme(fmt)
    if not sc.quantizes_weights:
        return ("grouped_mm",)
    if sc.per_tensor_scale:
        raise ValueError(f"{fmt}: a per-tensor scale, which quantized experts refuse (quarl.quant.experts)")
    return ("dequant", "kernel") if moe_kernel_supports(sc) else ("dequant",)


def moe_floor_seconds(fmt: str, e: int, t: int, n: int, k: int, ceil: Ceilings) -> float:
    """Floor of one projection of ``e`` experts on ``t`` rows each: every expert's weight read
    once at ``fmt``'s storage cost plus x and y in bf16 over the bandwidth, vs the FLOPs over
    the matrix rate (fp8's for formats that quantize activations)."""
    sc = get_scheme(fmt)
    m = e * t
    nbytes = e * n * k * sc.bits_per_weight / 8 + 2 * m * k + 2 * m * n
    rate = ceil.fp8_flops if sc.quantizes_activations else ceil.bf16_flops
    return max(nbytes / ceil.bandwidth, 2 * m * n * k / rate)


def even_offsets(e: int, t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 offsets of ``t`` rows per expert for ``e`` experts (the end of each expert's rows)."""
    return (torch.arange(1, e + 1, device=device, dtype=torch.int64) * t).to(torch.int32)


def make_moe_calls(fmt: str, method: str, shape: MoeShape, t: int, device: torch.device, l2: int,
                   seed: int = 0, tile=None) -> list[Callable[[], object]]:
    """One closure per rotating set: one projection of all experts on ``E x t`` sorted rows
    (``tile``: the grouped kernel's :class:`~quarl.quant.kernels.moe_gemm.MoeConfig`; None,
    its own choice)."""
    from quarl.model.moe import grouped_linear
    from quarl.quant import ops

    sc = get_scheme(fmt)
    e, n, k = shape.e, shape.n, shape.k
    m = e * t
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = n_sets(int(e * n * k * sc.bits_per_weight / 8 + 2 * m * k), l2)
    offsets = even_offsets(e, t, device)
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(sets)]

    def weight():
        return torch.randn(e, n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02

    if method == "grouped_mm":
        ws = [weight() for _ in range(sets)]
        return [lambda i=i: grouped_linear(xs[i], ws[i], offsets) for i in range(sets)]
    qws = [quantize_weight(weight().view(e * n, k), sc) for _ in range(sets)]  # (one bf16 copy at a time)
    if method == "kernel":
        from quarl.quant.kernels.moe_gemm import grouped_gemm

        def kernel(i: int):  # (W8A8: the rows quantized per token first, as in the dequantize path)
            x = xs[i] if sc.act_format == "none" else ops.quantize_input(xs[i], sc.act_format, torch.bfloat16)[2]
            return grouped_gemm(x, offsets, qws[i], e, tile)

        return [lambda i=i: kernel(i) for i in range(sets)]
    if method != "dequant":
        raise ValueError(f"unknown MoE method {method!r}; one of {MOE_METHODS}")

    def dequant(i: int):  # what grouped_quant_linear runs off the kernel (CUDA: the activations' dtype)
        x = xs[i] if sc.act_format == "none" else ops.quantize_input(xs[i], sc.act_format, torch.bfloat16)[2]
        return grouped_linear(x, ops.dequantize(qws[i], torch.bfloat16).view(e, n, k), offsets)

    return [lambda i=i: dequant(i) for i in range(sets)]


def run_moe_benchmark(
    models: list[str], tokens_per_expert: list[int], formats: list[str], reps: int = 20, graph: bool = True,
    log=print, partial_path: str | None = None, power: tuple[str | None, ...] = POWER_MODES, tiles: bool = False,
) -> dict:
    """Every MoE expert projection of ``models`` at ``t`` rows per expert, each format's methods
    (:func:`moe_methods`) against bf16's grouped GEMM in the same power state; with ``tiles``
    the grouped kernel also at each of ``moe_gemm.TILE_CANDIDATES`` (method ``kernel@...``)."""
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    gate = PowerGate()
    ceils = {p: measure_ceilings(device, p, gate) for p in power}
    if "bf16" not in formats:
        formats = ["bf16"] + list(formats)
    plan = [(fmt, method, None) for fmt in formats for method in moe_methods(fmt)]
    if tiles:
        from quarl.quant.kernels.moe_gemm import TILE_CANDIDATES, tile_label

        kernels = [fmt for fmt, method, _ in plan if method == "kernel"]
        plan += [(fmt, tile_label(c), c) for fmt in kernels for c in TILE_CANDIDATES]
    rows: list[dict] = []
    for model in models:
        for shape in moe_shapes(model):
            for t in tokens_per_expert:
                for p in power:
                    base = None
                    for fmt, method, tile in plan:
                        info: dict = {}
                        try:
                            calls = make_moe_calls(fmt, "kernel" if tile else method, shape, t, device, l2, tile=tile)
                            sec = time_per_call(calls, reps=reps, graph=graph, power=p, gate=gate, info=info)
                            err = None
                        except Exception as e:  # keep going; the failure is part of the result
                            sec, err = float("nan"), f"{type(e).__name__}: {e}"[:300]
                        calls = None
                        torch.cuda.empty_cache()
                        if fmt == "bf16":
                            base = sec
                        fl = moe_floor_seconds(fmt, shape.e, t, shape.n, shape.k, ceils[p])
                        rows.append(dict(
                            model=model, layer=shape.label, E=shape.e, N=shape.n, K=shape.k, tokens_per_expert=t,
                            M=shape.e * t, format=fmt, method=method, power=p, ms=sec * 1e3,
                            speedup=base / sec if base else float("nan"), floor_ms=fl * 1e3, floor_frac=fl / sec,
                            sm_mhz=(info.get("reading") or {}).get("sm_mhz"), error=err,
                        ))
                        log(_moe_line(rows[-1]))
                    if partial_path:
                        save(dict(device=props.name, ceilings=asdict(ceils[power[0]]), formats=formats, rows=rows),
                             partial_path)
    result = dict(
        mode="moe", device=props.name,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=git_commit(), torch=torch.__version__, triton=_triton_version(), cuda_graphs=graph,
        ceilings=asdict(ceils[power[0]]), ceilings_by_power={str(p): asdict(c) for p, c in ceils.items()},
        power=list(power), formats=formats, rows=rows,
    )
    result["layer_totals"] = moe_layer_totals(rows)
    return result


def _moe_line(r: dict) -> str:
    err = f"  ERROR {r['error']}" if r.get("error") else ""
    return (f"{r['model']:>13} {r['layer']:>12} {r['tokens_per_expert']:>6} {r['M']:>7} {_power_label(r):>9} "
            f"{r['format']:>10} {r['method']:>22} {r['ms'] * 1e3:>10.1f} {r['speedup']:>7.2f}x "
            f"{r['floor_ms'] * 1e3:>9.1f} {r['floor_frac']:>6.2f}{err}")


def moe_layer_totals(rows: list[dict]) -> list[dict]:
    """Per model, rows per expert, power state, format and method: the MoE layer's time (both
    projections) vs bf16's grouped GEMM in the same state."""
    acc: dict[tuple, float] = {}
    for r in rows:
        key = (r["model"], r["tokens_per_expert"], r.get("power"), r["format"], r["method"])
        acc[key] = acc.get(key, 0.0) + r["ms"]
    out = []
    for (model, t, power, fmt, method), ms in acc.items():
        base = acc.get((model, t, power, "bf16", "grouped_mm"))
        out.append(dict(model=model, tokens_per_expert=t, power=power, format=fmt, method=method, layer_ms=ms,
                        speedup=base / ms if base else float("nan")))
    return out


def format_moe_table(result: dict) -> str:
    """The MoE mode's rows (one per projection, rows per expert, power state, format and
    method) and the per-layer totals."""
    lines = [f"# {result['device']}  {result['date']}  commit {result['git_commit'][:10]}  (MoE experts)"]
    for p, c in (result.get("ceilings_by_power") or {"None": result["ceilings"]}).items():
        lines.append(f"# ceilings{'' if p == 'None' else ' (' + p + ')'}: {c['bandwidth'] / 1e12:.2f} TB/s, bf16 "
                     f"{c['bf16_flops'] / 1e12:.0f} TFLOP/s, fp8 {c['fp8_flops'] / 1e12:.0f} TFLOP/s")
    lines.append(f"{'model':>13} {'layer':>12} {'t/exp':>6} {'M':>7} {'power':>9} {'format':>10} {'method':>22} "
                 f"{'us':>10} {'vs bf16':>8} {'floor us':>9} {'floor':>6}")
    lines += [_moe_line(r) for r in result["rows"]]
    lines.append("(t/exp: rows per expert, every expert reached; vs bf16: bf16 grouped_mm time / this time, same "
                 "power state; floor: max(weights of all experts at the format's storage cost + x + y in bf16 / "
                 "bandwidth, FLOPs / matrix rate), floor column = floor / time; methods: grouped_mm = bf16 "
                 "F.grouped_mm, dequant = dequantize to bf16 + grouped_mm, kernel = the grouped kernel, moe_gemm)")
    totals = result.get("layer_totals") or moe_layer_totals(result["rows"])
    if totals:
        lines.append("MoE layer (gate_up + down):")
        for r in totals:
            lines.append(f"{r['model']:>13} t/exp={r['tokens_per_expert']:<6} {_power_label(r):>9} {r['format']:>10} "
                         f"{r['method']:>10} {r['layer_ms'] * 1e3:>10.1f} us {r['speedup']:>6.2f}x")
    return "\n".join(lines)
