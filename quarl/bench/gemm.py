"""GEMM benchmark of every format against bf16 on the linear shapes of real models.

Method (docs/performance.md): the two ceilings are measured first (device-to-device copy for
bandwidth, 8192^3 bf16 and fp8 products for the matrix rates) and each timing is
compared with its floor ``max(bytes / bandwidth, flops / rate)``, where bytes count the
weight once at the format's storage cost (scales included) plus x and y in bf16, and
the rate is the bf16 one for weight-only formats and the fp8 one for W8A8/W4A8. Each
measurement rotates among enough weight/input sets to exceed the L2 cache several
times, runs them inside a CUDA graph (as the rollout engine does) after warm-up, and
reports the median per-call time of many replays. Inputs are random normals.

Formats that quantize activations are timed as a standalone ``QuantLinear`` does it
(quantizer launch + GEMM). In the ``engine`` shape set, the GEMMs whose input the rollout
engine quantizes inside the op before (qkv and gate_up after its RMSNorm, down after its
SiLU-and-mul) are timed as the engine runs them instead: the GEMM on codes, plus what
fusing the quantizer adds to that op (the fused kernel writing codes minus the same
kernel writing bf16, measured). o_proj keeps its quantizer launch in both sets.

MoE mode (:func:`run_moe_benchmark`, ``quarl bench gemm --moe qwen3-30b-a3b``): each expert
projection of an MoE preset (gate_up: ``N = 2 I``, ``K = H``; down: ``N = H``, ``K = I``; ``E``
experts) on ``E x t`` rows sorted by expert, ``t`` rows per expert (an even routing: every
expert reached), timed three ways per format: bf16's grouped GEMM (``F.grouped_mm``), the
dequantize + grouped GEMM path the experts ran before the grouped kernel (``dequant``), and
the grouped w4 kernel (``kernel``, :mod:`quarl.quant.kernels.moe_gemm`, for the schemes it
runs). Each against its floor: all ``E`` experts' weights read once at the format's storage
cost plus x and y in bf16, over the measured bandwidth, vs the FLOPs over the matrix rate.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import asdict
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from quarl.bench.common import git_commit, write_json
from quarl.bench.timing import POWER_MODES, Ceilings, PowerGate, measure_ceilings, n_sets, time_per_call
from quarl.model.presets import PRESETS
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.ops import quant_linear
from quarl.quant.qweight import QuantizedWeight, quantize_weight
from quarl.quant.scheme import SCHEMES, get_scheme


def _dims(name: str) -> dict[str, int]:
    c = PRESETS[name]
    return dict(hidden=c["hidden_size"], inter=c["intermediate_size"], heads=c["num_attention_heads"],
                kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"])


# the released shapes' linears (quarl.model.presets); DEFAULT_MODELS are what `quarl bench gemm` runs unasked
MODELS: dict[str, dict[str, int]] = {n: _dims(n) for n in ("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")}
DEFAULT_MODELS = ("qwen2.5-1.5b", "qwen2.5-7b")
M_VALUES = (1, 16, 64, 256, 1024, 4096)


SHAPE_SETS = ("modules", "engine")


class Shape(NamedTuple):
    label: str
    n: int
    k: int
    counts: dict[str, int]  # per decoder layer, in each shape set


def linear_shapes(cfg: dict[str, int], sets: tuple[str, ...] = SHAPE_SETS) -> list[Shape]:
    """A model's distinct linear shapes with how often each runs per decoder layer.

    Two sets: ``modules`` (the seven linears of the checkpoint: q, k, v, o, gate, up,
    down) and ``engine`` (what the rollout engine runs: q/k/v fused into one
    ``[q + 2 kv]`` GEMM and gate/up into one ``[2 I]`` GEMM, see quarl.rollout.fused).
    Shapes of neither requested set are left out.
    """
    q, kv, h, i = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"], cfg["hidden"], cfg["inter"]
    shapes = [
        Shape("q_proj", q, h, {"modules": 1}),
        Shape("qkv_proj (fused)", q + 2 * kv, h, {"engine": 1}),
        Shape("k_proj/v_proj", kv, h, {"modules": 2}),
        Shape("o_proj", h, q, {"modules": 1, "engine": 1}),
        Shape("gate_proj/up_proj", i, h, {"modules": 2}),
        Shape("gate_up_proj (fused)", 2 * i, h, {"engine": 1}),
        Shape("down_proj", h, i, {"modules": 1, "engine": 1}),
    ]
    if q == h:  # q_proj and o_proj share a shape
        shapes = [Shape("q_proj/o_proj", q, h, {"modules": 2, "engine": 1})] + [
            s for s in shapes if s.label not in ("q_proj", "o_proj")]
    out = []
    for s in shapes:
        counts = {k: v for k, v in s.counts.items() if k in sets}
        if counts:
            out.append(s._replace(counts=counts))
    return out


def slice_qw(big: QuantizedWeight, i: int, n: int, k: int) -> QuantizedWeight:
    parts = {f: (t[i * n : (i + 1) * n] if t.dim() > 0 else t) for f, t in big.tensors().items()}
    return QuantizedWeight(big.scheme, (n, k), **parts)


def scheme_of(fmt: str) -> str:
    """The scheme of a format name: ``"w4a16+exact"`` -> ``"w4a16"`` (``+exact``: exact mode's
    batch-invariant GEMM of that scheme, :mod:`quarl.quant.kernels.invariant`)."""
    return fmt.removesuffix("+exact")


def make_calls(fmt: str, m: int, n: int, k: int, device: torch.device, l2: int,
               seed: int = 0) -> list[Callable[[], object]]:
    """One closure per rotating set: ``y = linear(x_i, W_i)`` under format ``fmt`` (``+exact``:
    the batch-invariant GEMM exact mode's engine runs, at its own tile for M; W8A8 with its
    per-row activation quantizer)."""
    sc = get_scheme(scheme_of(fmt))
    exact = fmt != sc.name
    gen = torch.Generator(device=device).manual_seed(seed)
    per_set = int(n * k * sc.bits_per_weight / 8 + m * k * 2)
    sets = n_sets(per_set, l2)
    w = torch.randn(sets * n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(sets, m, k, device=device, dtype=torch.bfloat16, generator=gen)
    if not sc.quantizes_weights:
        ws = w  # (the closures keep the bf16 weights; the quantized path drops them below)
        if exact:
            from quarl.quant.kernels.invariant import dense_gemm

            return [lambda i=i: dense_gemm(x[i], ws[i * n : (i + 1) * n]) for i in range(sets)]
        return [lambda i=i: F.linear(x[i], ws[i * n : (i + 1) * n]) for i in range(sets)]
    big = quantize_weight(w, sc)
    del w
    qws = [slice_qw(big, i, n, k) for i in range(sets)]
    if exact:
        return [_exact_call(x[i], qw) for i, qw in enumerate(qws)]
    repacked = [RepackCache() for _ in range(sets)]  # as each QuantLinear owns its kernel layouts
    return [lambda i=i: quant_linear(x[i], qws[i], None, repacked[i]) for i in range(sets)]


def _exact_call(x: torch.Tensor, qw: QuantizedWeight) -> Callable[[], object]:
    """Exact mode's GEMM of ``x`` on the packed ``qw``: the invariant weight-only GEMM, or the
    per-row activation codes then the invariant code GEMM (W8A8)."""
    from quarl.quant.kernels import invariant as inv
    from quarl.quant.kernels.act_quant import act_quant

    if qw.scheme.quantizes_activations:
        return lambda: inv.w8a8_gemm(*act_quant(x, qw.scheme.act_format), qw, None, x.dtype)
    return lambda: inv.weight_only_gemm(x, qw)


# Engine shapes whose input the rollout engine quantizes inside the op before (its fused
# RMSNorm, or SiLU-and-mul), for W8A8 / W4A8 formats (quarl.rollout.fused): the producer.
ENGINE_QUANTIZED_INPUT = {"qkv_proj (fused)": "rmsnorm", "gate_up_proj (fused)": "rmsnorm", "down_proj": "silu_mul"}


def engine_split(label: str, counts: dict[str, int], fmt: str) -> tuple[dict[str, int], dict[str, int]]:
    """``(counts of the row timed with the standalone quantizer, counts of the row timed as the
    engine runs it)``: for a format that quantizes activations, an engine shape in
    ``ENGINE_QUANTIZED_INPUT`` is timed twice (the module set keeps the quantizer's launch);
    otherwise one row keeps every count."""
    if fmt == scheme_of(fmt) and get_scheme(fmt).quantizes_activations and label in ENGINE_QUANTIZED_INPUT \
            and "engine" in counts:
        return {k: v for k, v in counts.items() if k != "engine"}, {"engine": counts["engine"]}
    return counts, {}


def quantized_operands(fmt: str, m: int, n: int, k: int, device: torch.device, l2: int, seed: int):
    """Rotating sets of (weight of format ``fmt``, activations already quantized per token)."""
    from quarl.quant.kernels import launch

    sc = get_scheme(fmt)
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = n_sets(int(n * k * sc.bits_per_weight / 8 + m * k), l2)
    w = torch.randn(sets * n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    big = quantize_weight(w, sc)
    del w
    qws = [slice_qw(big, i, n, k) for i in range(sets)]
    xs = [launch.act_quant(torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen), sc.act_format)
          for _ in range(sets)]
    return qws, xs


def make_calls_quantized_input(fmt: str, m: int, n: int, k: int, device: torch.device, l2: int, seed: int = 0):
    """As :func:`make_calls`, on activations quantized beforehand: the GEMM alone."""
    from quarl.quant.kernels import launch

    qws, xs = quantized_operands(fmt, m, n, k, device, l2, seed)
    return [lambda i=i: launch.linear_quantized_input(*xs[i], qws[i], None, torch.bfloat16) for i in range(len(qws))]


def producer_extra_seconds(producer: str, act: str, m: int, k: int, device: torch.device, tk: dict) -> float:
    """What fusing the quantizer costs the op before the GEMM: time of the engine's fused
    ``producer`` writing codes + scales minus the same kernel writing bf16 (negative when the
    smaller write makes it faster). ``k`` is the GEMM's K (the producer's row length)."""
    from quarl.rollout import fused

    x = torch.randn(m, 2 * k if producer == "silu_mul" else k, device=device, dtype=torch.bfloat16)
    w = torch.ones(k, device=device, dtype=torch.bfloat16)

    def run(quant):
        if producer == "silu_mul":
            return lambda: fused.silu_mul(x[:, :k], x[:, k:], quant=quant)
        return lambda: fused.rmsnorm(x, w, 1e-6, quant=quant)

    return time_per_call([run(act)], **tk) - time_per_call([run(None)], **tk)


def gated_mlp(fmt: str, m: int, hidden: int, inter: int) -> bool:
    """Whether the engine runs the MLP's gate/up of format ``fmt`` at M rows as the gated W8A8
    GEMM (SiLU-and-mul in its epilogue; ``dispatch.gated_plan``)."""
    from quarl.quant.kernels import dispatch
    from quarl.rollout.fused import FUSED_QUANTIZERS

    sc = get_scheme(fmt)
    return (sc.act_format in FUSED_QUANTIZERS and not sc.packed
            and dispatch.gated_plan(sc.act_format, m, 2 * inter, hidden) is not None)


def make_calls_gated(fmt: str, m: int, n: int, k: int, device: torch.device, l2: int, seed: int = 0):
    """The engine's gated gate/up (``n = 2 I`` rows) on quantized input: the GEMM with
    SiLU-and-mul in its epilogue, then down_proj's per-token quantizer from its row maxima."""
    from quarl.quant.kernels import launch

    act = get_scheme(fmt).act_format
    qws, xs = quantized_operands(fmt, m, n, k, device, l2, seed)

    def call(i):
        y, amax = launch.gated_silu_gemm(*xs[i], qws[i], torch.bfloat16)
        return launch.act_quant_from_partials(y, amax, act)

    return [lambda i=i: call(i) for i in range(len(qws))]


def silu_mul_seconds(m: int, inter: int, device: torch.device, tk: dict) -> float:
    """The bf16 engine's SiLU-and-mul on ``[M, 2 I]`` (what the gated GEMM saves)."""
    from quarl.rollout import fused

    x = torch.randn(m, 2 * inter, device=device, dtype=torch.bfloat16)
    return time_per_call([lambda: fused.silu_mul(x[:, :inter], x[:, inter:])], **tk)


def floor_seconds(fmt: str, m: int, n: int, k: int, ceil: Ceilings) -> float:
    sc = get_scheme(scheme_of(fmt))
    nbytes = n * k * sc.bits_per_weight / 8 + 2 * m * k + 2 * m * n
    rate = ceil.fp8_flops if sc.quantizes_activations else ceil.bf16_flops
    return max(nbytes / ceil.bandwidth, 2 * m * n * k / rate)


def engine_row_seconds(label, fmt, m, n, k, device, l2, tk: dict, extra: dict) -> tuple[float, dict]:
    """Time of an engine-set W8A8 GEMM as the engine runs it, and what the row says about its
    input. In general: the GEMM on codes plus what the fused quantizer adds to the op before
    (``producer_extra_seconds``, cached in ``extra``). Where the MLP runs the gated gate/up
    (``gated_mlp``), the gate/up row is the gated GEMM + down's quantizer, minus the bf16
    engine's SiLU-and-mul (it no longer runs), plus the RMSNorm quantizer's extra; the down
    row is its GEMM on codes alone (its quantizer is counted in the gate/up row)."""
    act = get_scheme(fmt).act_format

    def cached(key, fn):
        if key not in extra:
            extra[key] = fn()
        return extra[key]

    inter, hidden = (n // 2, k) if label == "gate_up_proj (fused)" else (k, n)
    if gated_mlp(fmt, m, hidden, inter) and label in ("gate_up_proj (fused)", "down_proj"):
        if label == "down_proj":
            t = time_per_call(make_calls_quantized_input(fmt, m, n, k, device, l2), **tk)
            return t, dict(input="quantized by the gated gate/up GEMM's row quantizer (counted in that row)",
                           producer_extra_ms=0.0)
        power = tk.get("power")
        norm = cached(("rmsnorm", act, m, k, power), lambda: producer_extra_seconds("rmsnorm", act, m, k, device, tk))
        silu = cached(("silu_bf16", m, inter, power), lambda: silu_mul_seconds(m, inter, device, tk))
        t = time_per_call(make_calls_gated(fmt, m, n, k, device, l2), **tk) - silu + norm
        return t, dict(input="quantized by the fused rmsnorm; SiLU-and-mul in the GEMM epilogue, down's quantizer "
                             "included, the bf16 SiLU-and-mul subtracted", producer_extra_ms=(norm - silu) * 1e3)
    key = (ENGINE_QUANTIZED_INPUT[label], act, m, k)
    add = cached(key + (tk.get("power"),), lambda: producer_extra_seconds(*key, device, tk))
    t = time_per_call(make_calls_quantized_input(fmt, m, n, k, device, l2), **tk) + add
    return t, dict(input=f"quantized by the fused {ENGINE_QUANTIZED_INPUT[label]}", producer_extra_ms=add * 1e3)


def run_benchmark(
    models: list[str], ms: list[int], formats: list[str], reps: int = 20, graph: bool = True, log=print,
    partial_path: str | None = None, sets: tuple[str, ...] = SHAPE_SETS, power: tuple[str | None, ...] = POWER_MODES,
) -> dict:
    """Every format against bf16 at every shape and M, in each power state of ``power``
    (:mod:`quarl.bench.timing`: ``burst``, ``sustained``; None: as found), bf16 first within
    a state, so that each ratio compares two timings of one state."""
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    gate = PowerGate()
    ceils = {p: measure_ceilings(device, p, gate) for p in power}
    for p, ceil in ceils.items():
        log(f"ceilings{'' if p is None else ' (' + p + ')'}: {ceil.bandwidth / 1e12:.2f} TB/s, "
            f"bf16 {ceil.bf16_flops / 1e12:.0f} TFLOP/s, fp8 {ceil.fp8_flops / 1e12:.0f} TFLOP/s")
    if "bf16" not in formats:
        formats = ["bf16"] + formats
    rows, engine_rows = [], []
    extra: dict[tuple, float] = {}
    for model in models:
        for label, n, k, counts in linear_shapes(MODELS[model], sets):
            for m in ms:
                for p in power:
                    base = None
                    for fmt in formats:
                        own, fused_in = engine_split(label, counts, fmt)
                        fl = floor_seconds(fmt, m, n, k, ceils[p])
                        for kind, cnt in (("standalone", own), ("engine", fused_in)):
                            if kind == "engine" and not cnt:
                                continue
                            info: dict = {}
                            tk = dict(reps=reps, graph=graph, power=p, gate=gate, info=info)
                            try:
                                if kind == "standalone":
                                    t = time_per_call(make_calls(fmt, m, n, k, device, l2), **tk)
                                else:
                                    t, note = engine_row_seconds(label, fmt, m, n, k, device, l2, tk, extra)
                                err = None
                            except Exception as e:  # keep going; the failure is part of the result
                                t, err = float("nan"), f"{type(e).__name__}: {e}"[:300]
                            if fmt == "bf16":
                                base = t
                            reading = info.get("reading") or {}
                            row = dict(
                                model=model, layer=label, counts=cnt, N=n, K=k, M=m, format=fmt, power=p,
                                ms=t * 1e3, speedup=base / t if base else float("nan"),
                                floor_ms=fl * 1e3, floor_frac=fl / t, sm_mhz=reading.get("sm_mhz"), error=err,
                            )
                            if kind == "engine":
                                row.update(note if err is None
                                           else dict(input="not timed (error)", producer_extra_ms=float("nan")))
                                engine_rows.append(row)
                            else:
                                rows.append(row)
                        torch.cuda.empty_cache()
                    log(_row_line(rows[-len(formats):]))
                    for r in engine_rows:
                        if r["model"] == model and r["layer"] == label and r["M"] == m and r["power"] == p:
                            log(f"{'':>13} {'':>17} {'':<7} {r['format']} as the engine runs it (input {r['input']}): "
                                f"{r['speedup']:.2f}x")
                    if partial_path:
                        save(dict(device=props.name, ceilings=asdict(ceils[power[0]]), formats=formats, rows=rows),
                             partial_path)
    result = dict(
        device=props.name, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=git_commit(), torch=torch.__version__, triton=_triton_version(), cuda_graphs=graph,
        ceilings=asdict(ceils[power[0]]), ceilings_by_power={str(p): asdict(c) for p, c in ceils.items()},
        power=list(power), formats=formats, rows=rows + engine_rows,
    )
    result["shape_sets"] = list(sets)
    summarize(result)
    return result


def summarize(result: dict) -> dict:
    """(Re)compute ``layer_speedups`` and ``targets`` of a result from all its rows."""
    rows, sets = result["rows"], result["shape_sets"]
    result["layer_speedups"] = [x for st in sets for x in layer_speedups(rows, st)]
    result["targets"] = [x for st in sets for x in check_targets(rows, shape_set=st)]
    return result


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:
        return "none"


def _power_label(r: dict) -> str:
    """A row's power state as the tables print it ('' for rows timed as found)."""
    return r.get("power") or ""


def _row_line(rows: list[dict]) -> str:
    r0 = rows[0]
    cells = " ".join(f"{r['format']}={r['speedup']:.2f}x" for r in rows[1:])
    clock = f" {r0['sm_mhz']:.0f}MHz" if r0.get("sm_mhz") else ""
    return (f"{r0['model']:>13} {r0['layer']:>17} M={r0['M']:<5} {_power_label(r0):>9}{clock} "
            f"bf16={r0['ms'] * 1e3:8.1f}us {cells}")


def layer_speedups(rows: list[dict], shape_set: str = "modules") -> list[dict]:
    """Per model, M, power state and format: time of all linears of one decoder layer vs
    bf16's in the same state, with the shapes and counts of ``shape_set``."""
    acc: dict[tuple, float] = {}
    for r in rows:
        count = r["counts"].get(shape_set, 0)
        if count:
            key = (r["model"], r["M"], r.get("power"), r["format"])
            acc[key] = acc.get(key, 0.0) + r["ms"] * count
    out = []
    for (model, m, power, fmt), t in acc.items():
        base = acc.get((model, m, power, "bf16"))
        out.append(dict(model=model, shapes=shape_set, M=m, power=power, format=fmt, layer_ms=t,
                        speedup=base / t if base else float("nan")))
    return out


TARGETS = (  # (format, predicate on M, min speedup) on the 7B shapes
    ("w4a16", "M<=16", lambda m: m <= 16, 2.5),
    ("w4a16", "M=64", lambda m: m == 64, 1.4),
    ("w4a16", "M=128", lambda m: m == 128, 1.5),
    ("w4a16", "M=256", lambda m: m == 256, 1.0),
    ("w4a16", "M=1024", lambda m: m == 1024, 1.0),
    ("w4a16", "M=4096", lambda m: m == 4096, 1.0),
    ("w8a8-fp8", "M>=256", lambda m: m >= 256, 1.4),
    ("w8a8-int8", "M>=256", lambda m: m >= 256, 1.3),
)


def check_targets(rows: list[dict], model: str = "qwen2.5-7b", shape_set: str = "modules") -> list[dict]:
    """Each target's geomean and worst speedup over the rows of ``model`` in ``shape_set``, per
    power state."""
    out = []
    powers = list(dict.fromkeys(r.get("power") for r in rows))
    for (fmt, label, pred, want), power in ((t, p) for t in TARGETS for p in powers):
        got = [r for r in rows if r["model"] == model and r["format"] == fmt and pred(r["M"])
               and r["counts"].get(shape_set) and r.get("power") == power]
        if not got:
            continue
        sp = [r["speedup"] for r in got]
        geo = math.exp(sum(math.log(s) for s in sp) / len(sp)) if all(s > 0 for s in sp) else float("nan")
        worst = min(got, key=lambda r: r["speedup"])
        out.append(dict(
            format=fmt, shapes=shape_set, power=power, where=label, target=want, geomean=geo, min=worst["speedup"],
            min_at=f"{worst['layer']} M={worst['M']}", met_geomean=geo >= want, met_all=worst["speedup"] >= want,
        ))
    return out


def format_table(result: dict) -> str:
    lines = [f"# {result['device']}  {result['date']}  commit {result['git_commit'][:10]}"]
    for p, c in (result.get("ceilings_by_power") or {"None": result["ceilings"]}).items():
        lines.append(f"# ceilings{'' if p == 'None' else ' (' + p + ')'}: {c['bandwidth'] / 1e12:.2f} TB/s, bf16 "
                     f"{c['bf16_flops'] / 1e12:.0f} TFLOP/s, fp8 {c['fp8_flops'] / 1e12:.0f} TFLOP/s")
    fmts = result["formats"]
    lines.append(f"{'model':>13} {'layer':>17} {'M':>5} {'power':>9} {'bf16 us':>8} "
                 + " ".join(f"{f:>10}" for f in fmts[1:]))
    rows = [r for r in result["rows"] if "input" not in r]
    for i in range(0, len(rows), len(fmts)):
        grp = rows[i : i + len(fmts)]
        r0 = grp[0]
        lines.append(
            f"{r0['model']:>13} {r0['layer']:>17} {r0['M']:>5} {_power_label(r0):>9} {r0['ms'] * 1e3:>8.1f} "
            + " ".join(f"{r['speedup']:>5.2f}x/{r['floor_frac']:.2f}" for r in grp[1:])
        )
    lines.append("(cells: speedup over bf16 in the same power state / fraction of the format's floor at that state's "
                 "ceilings; power: burst = timed right after a cool-down, sustained = after 0.5 s of the same load; "
                 "shape sets: modules = the checkpoint's seven linears, engine = what the rollout engine runs, "
                 "q/k/v and gate/up fused)")
    fused_rows = [r for r in result["rows"] if "input" in r]
    if fused_rows:
        lines.append("engine set, W8A8 GEMMs whose input the engine quantizes in the op before "
                     "(time = GEMM on the codes + what the fused quantizer adds to that op):")
        for r in fused_rows:
            lines.append(f"{r['model']:>13} {r['layer']:>17} {r['M']:>5} {_power_label(r):>9} {r['format']:>10} "
                         f"{r['speedup']:>5.2f}x (fused quantizer {r['producer_extra_ms'] * 1e3:+.1f} us; "
                         f"input {r['input']})")
    for t in result["targets"]:
        ok = "MET" if t["met_all"] else ("met on geomean" if t["met_geomean"] else "MISSED")
        state = f", {t['power']}" if t.get("power") else ""
        lines.append(f"target {t['format']} {t['where']} >= {t['target']}x ({t['shapes']} shapes{state}): "
                     f"geomean {t['geomean']:.2f}x, min {t['min']:.2f}x ({t['min_at']}): {ok}")
    return "\n".join(lines)


def save(result: dict, path: str) -> None:
    write_json(result, path, indent=1)


# every scheme, and exact mode's invariant GEMMs of those it runs (``+exact``)
EXACT_FORMATS = ["bf16+exact", "w4a16+exact", "w4a16-asym+exact", "w2a16+exact", "w8a8-int8+exact",
                 "w8a8-fp8+exact"]
DEFAULT_FORMATS = list(SCHEMES)
ALL_FORMATS = DEFAULT_FORMATS + EXACT_FORMATS
