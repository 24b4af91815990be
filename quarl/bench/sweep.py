"""Kernel-config sweeps behind the dispatch tables (``quarl bench sweep FAMILY``).

One question per call: at each M and shape, which candidate config of one kernel family
is fastest, against bf16 and the table's current choice? Every candidate runs through
``dispatch.overrides`` on the same path the engine and ``QuantLinear`` take, is checked
once against the default's output on the first operand set (GEMMs: relative error below
``REL_TOL`` and the same bits on a second run; quantizers and the gated GEMM: the same
codes bit for bit), then timed as ``quarl bench gemm`` times (CUDA-graph replays over
rotating operand sets beyond L2, median of CUDA events). A failing candidate is a row
with an error, not a crash.

Candidates are written as specs (``parse_candidates``): ``[kernel:]values`` where values
are the config's fields in order and/or ``field=value``, and any value may be a grid
``a|b|c``; ``;`` or newlines separate candidates. E.g. for ``wgmma``:
``2,4,blocks_per_sm=1|2,cluster=1`` is ``WgConfig(2, 4, 1.0, cluster=True)`` and the same
at 2 blocks per SM. The winners go into the rows of ``quarl/quant/kernels/tables.py`` by
hand, with the evidence in docs/kernels.md.
"""

from __future__ import annotations

import datetime
import functools
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

# the candidates and their specs live in sweep_candidates (pure); the CLI and the tests take them from here too
from quarl.bench.sweep_candidates import (  # noqa: F401
    FAMILIES, KERNEL_CONFIGS, ActQuantConfig, Candidate, Family, family, family_shapes, format_candidate,
    parse_candidates, parse_shapes,
)

REL_TOL = 1e-2  # GEMM candidates: relative error against the default's output (bf16 outputs)


# ---------------------------------------------------------------- summary (pure)

def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs and all(x > 0 for x in xs) else math.nan


def summarize(rows: list[dict]) -> list[dict]:
    """Per M, over the shapes where the default ran: geomean time ratios of the default over
    bf16 (``default_speedup``), and of the best candidate per shape and the best single
    candidate (the one with the best geomean among those that ran on every shape) over
    bf16 and over the default."""
    out = []
    for m in sorted({r["M"] for r in rows}):
        mine = [r for r in rows if r["M"] == m and r["us"] == r["us"]]
        times: dict[str, dict[str, float]] = {}
        for r in mine:
            times.setdefault(r["cfg"], {})[r["layer"]] = r["us"]
        default = times.get("default", {})
        layers = sorted(default)
        if not layers:
            continue
        bf16 = {r["layer"]: r["bf16_us"] for r in mine}
        cands = {c: t for c, t in times.items() if c not in ("default", "plain")}
        best = {lay: min((t[lay] for t in cands.values() if lay in t), default=math.nan) for lay in layers}
        full = {c: _geomean([t[lay] for lay in layers]) for c, t in cands.items() if all(lay in t for lay in layers)}
        single = min(full, key=full.get) if full else None
        single_t = cands[single] if single else {lay: math.nan for lay in layers}

        def ratio(num, den):
            return _geomean([num[lay] / den[lay] for lay in layers])

        out.append(dict(
            M=m, layers=layers, default_speedup=ratio(bf16, default),
            best_per_shape_speedup=ratio(bf16, best), best_per_shape_vs_default=ratio(default, best),
            best_single=single, best_single_speedup=ratio(bf16, single_t),
            best_single_vs_default=ratio(default, single_t),
        ))
    return out


def summary_lines(summary: list[dict]) -> list[str]:
    return [f"M={s['M']}: {len(s['layers'])} shapes, geomean over bf16 / over the default: default "
            f"{s['default_speedup']:.2f}x, best per shape {s['best_per_shape_speedup']:.2f}x / "
            f"{s['best_per_shape_vs_default']:.2f}x, best single {s['best_single_speedup']:.2f}x / "
            f"{s['best_single_vs_default']:.2f}x ({s['best_single']})" for s in summary]


def best_line(rows: list[dict]) -> str:
    """One line per (M, shape): bf16, the default's speedup and the fastest candidate."""
    r0 = rows[0]
    ok = [r for r in rows if r["us"] == r["us"] and r["cfg"] != "default"]
    dflt = next((r for r in rows if r["cfg"] == "default"), None)
    best = min(ok, key=lambda r: r["us"]) if ok else None
    dtext = f"{dflt['speedup']:.2f}x ({dflt['plan']})" if dflt else "-"
    btext = f"{best['us']:7.1f}us {best['speedup']:.2f}x {best['cfg']}" if best else "none ran"
    return f"M={r0['M']:<5} {r0['layer']:>22} bf16 {r0['bf16_us']:7.1f}us default {dtext}  best {btext}"


def _table_spec(fam: Family, fmt: str, gen: str, m: int, n: int, k: int) -> str:
    """The spec of the plan the dispatch tables pick now for one (M, shape) of ``fam``
    (``gen``: the w4a16 row set, e.g. ``sm90``; the other tables have one)."""
    from quarl.quant.kernels import dispatch
    from quarl.quant.scheme import get_scheme

    if fam.operands == "act_quant":
        return format_candidate(ActQuantConfig(*dispatch.act_quant_plan(m, k)))
    if fam.operands == "gated":
        plan = dispatch.gated_plan(get_scheme(fmt).act_format, m, n, k)
        return "plain (no gated GEMM)" if plan is None else format_candidate(plan)
    plan = dispatch.lookup(fam.table, gen if fam.table == "w4a16" else "none", m, n, k)
    return "-" if plan is None else format_candidate(plan)


def sweep_gen(result: dict) -> str:
    """The w4a16 row set of the GPU a saved sweep ran on (from its device name)."""
    name = str(result.get("device", ""))
    for marks, gen in ((("H100", "H200", "H800", "H20", "GH200"), "sm90"),
                       (("A100", "A800", "A10", "A30", "A40"), "sm80"),
                       (("L4", "L40", "RTX 40", "RTX 6000 Ada"), "sm89")):
        if any(mark in name for mark in marks):
            return gen
    raise ValueError(f"cannot tell the GPU generation of a sweep run on {name!r}; pass --gen (sm90, sm89, sm80)")


def against_table(result: dict, gen: str | None = None) -> list[dict]:
    """The dispatch tables as they are now, replayed over a saved sweep (``run_sweep``'s
    JSON): per (M, shape) the plan picked then (its ``default``) and now, the time of each in
    that sweep (now: NaN when the plan was not among its candidates; a plan timed more than
    once, as the default and as a candidate, takes its fastest time: interference only slows a
    timing down), and the fastest candidate. No GPU: it answers "does the table pick each
    sweep's winner?" after rows change."""
    fam = family(result["family"])
    gen = gen or sweep_gen(result)
    groups: dict[tuple, list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["M"], r["layer"], r["N"], r["K"]), []).append(r)
    out = []
    for (m, layer, n, k), rows in groups.items():
        ran = {r["cfg"]: r for r in rows if not r.get("error") and r["us"] == r["us"]}
        then = ran.get("default")
        now = _table_spec(fam, result["format"], gen, m, n, k)
        now_row = ran.get("plain" if now.startswith("plain") else now)
        if now_row is None and then is not None and then.get("plan") == now:
            now_row = then
        fastest: dict[str, float] = {}  # plan -> its fastest time in the sweep
        for r in ran.values():
            spec = r.get("plan", "default") if r["cfg"] == "default" else r["cfg"]
            fastest[spec] = min(fastest.get(spec, math.inf), r["us"])
        best = min(ran.values(), key=lambda r: r["us"]) if ran else None
        out.append(dict(
            M=m, layer=layer, N=n, K=k, bf16_us=rows[0]["bf16_us"],
            then_plan=then.get("plan", "-") if then else "-",
            then_us=fastest.get(then.get("plan", "default"), then["us"]) if then else math.nan,
            now_plan=now, now_us=min(now_row["us"], fastest.get(now, math.inf)) if now_row else math.nan,
            best_cfg=(best.get("plan", "default") if best["cfg"] == "default" else best["cfg"]) if best else "-",
            best_us=best["us"] if best else math.nan,
        ))
    return out


def against_lines(rows: list[dict], slack: float = 1.05) -> list[str]:
    """One line per (M, shape), marked ``<<`` where the table's plan now is more than
    ``slack`` times the fastest candidate's time or was not swept; then per M the geomean
    speedup over bf16 of the plans picked then and now (over the shapes swept with both)."""
    lines = []
    for r in rows:
        now = f"{r['now_us']:7.1f}" if r["now_us"] == r["now_us"] else "  (not swept)"
        off = not r["now_us"] <= slack * r["best_us"]
        lines.append(f"M={r['M']:<5} {r['layer']:>22} bf16 {r['bf16_us']:7.1f}us  then {r['then_us']:7.1f}  now {now}"
                     f"  best {r['best_us']:7.1f} {r['best_cfg']}  now: {r['now_plan']}{'  <<' if off else ''}")
    for m in sorted({r["M"] for r in rows}):
        both = [r for r in rows if r["M"] == m and r["now_us"] == r["now_us"] and r["then_us"] == r["then_us"]]
        if both:
            then = _geomean([r["bf16_us"] / r["then_us"] for r in both])
            now = _geomean([r["bf16_us"] / r["now_us"] for r in both])
            lines.append(f"M={m}: {len(both)} shapes, geomean over bf16: then {then:.2f}x, now {now:.2f}x")
    return lines


# ---------------------------------------------------------------- GPU

@dataclass
class Bench:
    """One (M, shape) of a family: the op over rotating operand sets (it picks its kernel
    when called, so ``dispatch.overrides`` around a call or a graph capture decides),
    and bf16 doing the same work."""

    calls: list[Callable[[], Any]]
    bf16: list[Callable[[], Any]] | None
    exact: bool  # outputs are codes: compare bit for bit
    bytes: float  # moved per call at the format's storage cost (for the floor)
    plain: list[Callable[[], Any]] | None = None  # gated: the path without the gated GEMM


def _build(fam: Family, fmt: str, m: int, n: int, k: int, dev, l2: int) -> Bench:
    import torch

    from quarl.bench import gemm
    from quarl.quant.kernels import dispatch, launch
    from quarl.quant.scheme import get_scheme

    sc = get_scheme(fmt)
    if fam.operands == "act_quant":
        xs = torch.randn(8, m, k, device=dev, dtype=torch.bfloat16)
        return Bench([lambda i=i: launch.act_quant(xs[i], sc.act_format) for i in range(8)], None, True,
                     3 * m * k + 4 * m)
    nbytes = n * k * sc.bits_per_weight / 8 + 2 * m * k + 2 * m * n
    bf16 = gemm.make_calls("bf16", m, n, k, dev, l2)
    if fam.operands == "weight_only":
        return Bench(gemm.make_calls(fmt, m, n, k, dev, l2), bf16, False, nbytes)
    if fam.operands == "quantized_input":
        return Bench(gemm.make_calls_quantized_input(fmt, m, n, k, dev, l2), bf16, False, nbytes)
    from quarl.rollout import fused

    inter, act = n // 2, sc.act_format
    qws, xs = gemm.quantized_operands(fmt, m, n, k, dev, l2, 0)

    def plain(i):
        gu = launch.linear_quantized_input(*xs[i], qws[i], None, torch.bfloat16)
        return fused.silu_mul(gu[:, :inter], gu[:, inter:], quant=act)

    def engine(i):  # what the engine runs: the gated GEMM where a plan applies, else the plain path
        plan = dispatch.pick_gated(qws[i], m)
        if plan is None:
            return plain(i)
        r = plan.run(*xs[i], qws[i], torch.bfloat16)
        if r is None:  # the engine would fall back to the plain path: not this candidate's time
            raise RuntimeError(f"{plan} declined these operands (TMA cannot describe them)")
        return launch.act_quant_from_partials(*r, act)

    def bf16_gated(i):
        gu = bf16[i % len(bf16)]()
        return fused.silu_mul(gu[:, :inter], gu[:, inter:])

    return Bench([lambda i=i: engine(i) for i in range(len(qws))],
                 [lambda i=i: bf16_gated(i) for i in range(len(bf16))],
                 True, nbytes, plain=[lambda i=i: plain(i) for i in range(len(qws))])


def _same_bits(a, b) -> bool:
    import torch

    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def _differs(out, ref, exact: bool) -> str | None:
    if exact:
        return None if _same_bits(out, ref) else "codes differ from the reference path's"
    err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
    return None if err < REL_TOL else f"relative error {err:.3g} against the default (limit {REL_TOL})"


def _override(fam: Family, cand: Candidate | None):
    from quarl.quant.kernels import dispatch

    return dispatch.overrides(**({} if cand is None else {fam.table: cand}))


def _default_plan(fam: Family, fmt: str, m: int, n: int, k: int, dev) -> str:
    from quarl.quant.kernels.device import gpu_gen

    return _table_spec(fam, fmt, gpu_gen(dev, __import__("torch").bfloat16), m, n, k)


def time_candidate(fam: Family, b: Bench, cand: Candidate | None, ref, reps: int,
                   timer: Callable | None = None) -> tuple[float, Any, str | None]:
    """``(seconds per call, output on set 0, error)`` of one candidate (None: the default)."""
    from quarl.bench.timing import time_per_call

    try:
        with _override(fam, cand):
            out = b.calls[0]()
            again = b.calls[0]()
            if not _same_bits(again, out):
                return math.nan, out, "not deterministic (two runs on the same input differ)"
            if ref is not None and (why := _differs(out, ref, b.exact)):
                return math.nan, out, why
            return (timer or time_per_call)(b.calls, reps=reps), out, None
    except Exception as e:  # noqa: BLE001 - a failing candidate is a result
        return math.nan, None, f"{type(e).__name__}: {str(e)[:300]}"


def time_shape(fam: Family, b: Bench, cands: list[Candidate], reps: int, rounds: int = 1,
               timer: Callable | None = None) -> tuple[list[float], list[tuple[str, list[float], str | None]]]:
    """bf16's seconds per call and, per entry (``plain`` for a gated family, ``default``, then
    each candidate), its seconds per call in each of ``rounds`` rounds with its error. The first
    round checks each entry's output against the reference (the plain path, else the default);
    later rounds time again, in the same order, every entry that passed, so that a drift of the
    clocks or an interference hits all plans alike (keep each one's fastest)."""
    from quarl.bench.timing import time_per_call

    timer = timer or time_per_call
    bf16 = [timer(b.bf16, reps=reps)] if b.bf16 else []
    entries: list[tuple[str, Candidate | None, list[float], str | None]] = []
    ref = None
    if b.plain is not None:  # gated: the plain path is the reference and an entry of its own
        ref = b.plain[0]()
        entries.append(("plain", None, [timer(b.plain, reps=reps)], None))
    t, out, err = time_candidate(fam, b, None, ref, reps, timer)
    entries.append(("default", None, [t], err))
    ref = ref if ref is not None else out
    for cand in cands:
        t, _, err = time_candidate(fam, b, cand, ref, reps, timer)
        entries.append((format_candidate(cand), cand, [t], err))
    for _ in range(rounds - 1):
        if b.bf16:
            bf16.append(timer(b.bf16, reps=reps))
        for cfg, cand, ts, err in entries:
            if err is None and ts[0] == ts[0]:
                with _override(fam, cand):
                    ts.append(timer(b.plain if cfg == "plain" else b.calls, reps=reps))
    return bf16, [(cfg, ts, err) for cfg, _, ts, err in entries]


def run_sweep(fam_name: str, ms: list[int], shapes: list[tuple[str, int, int]], candidates: list[Candidate] | None,
              fmt: str | None = None, budget_s: float = 300.0, reps: int = 20, log=print,
              save: Callable[[dict], None] | None = None, rounds: int = 1, power: str | None = None) -> dict:
    """Time the default and each candidate (the family's own list at each M when None) at
    every M and shape, ``rounds`` times each (:func:`time_shape`; a row's ``us`` is its fastest,
    ``us_rounds`` all), in power state ``power`` (:mod:`quarl.bench.timing`; None: as found);
    stops starting new shapes after ``budget_s``."""
    import torch

    from quarl.bench.common import git_commit
    from quarl.bench.timing import PowerGate, measure_ceilings, time_per_call

    fam = family(fam_name)
    fmt = fmt or fam.format
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    gate = PowerGate()
    ceil = measure_ceilings(dev, power, gate)
    timer = None if power is None else functools.partial(time_per_call, power=power, gate=gate)
    result = dict(benchmark="sweep", family=fam_name, table=fam.table, format=fmt, device=props.name, power=power,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  git_commit=git_commit(), torch=torch.__version__, ceilings=asdict(ceil), reps=reps, rounds=rounds,
                  candidates="given" if candidates is not None else "family default", budget_spent=False, rows=[])
    rows: list[dict] = result["rows"]
    t0 = time.time()
    for m in ms:
        for label, n, k in family_shapes(fam, shapes):
            if time.time() - t0 > budget_s:
                result["budget_spent"] = True
                log(f"budget of {budget_s:.0f}s spent: stopped before M={m} {label}")
                break
            b = _build(fam, fmt, m, n, k, dev, l2)
            base = dict(family=fam_name, format=fmt, M=m, layer=label, N=n, K=k)
            cands = candidates if candidates is not None else fam.candidates(m)
            bf16s, entries = time_shape(fam, b, cands, reps, rounds, timer)
            t_bf16 = min(bf16s) if bf16s else math.nan
            here: list[dict] = []
            for cfg, ts, err in entries:
                t = min(ts)
                here.append(dict(base, cfg=cfg, us=t * 1e6, us_rounds=[x * 1e6 for x in ts], bf16_us=t_bf16 * 1e6,
                                 speedup=t_bf16 / t, floor_us=b.bytes / ceil.bandwidth * 1e6,
                                 eff_TBps=b.bytes / t / 1e12, error=err,
                                 **({"plan": _default_plan(fam, fmt, m, n, k, dev)} if cfg == "default" else {})))
                if err:
                    log(f"M={m} {label} {cfg}: {err}")
            rows += here
            log(best_line(here))
            del b
            torch.cuda.empty_cache()
            if save:
                save(result)
        if result["budget_spent"]:
            break
    result["summary"] = summarize(rows)
    for line in summary_lines(result["summary"]):
        log(line)
    return result


def run_once(fam_name: str, ms: list[int], shapes: list[tuple[str, int, int]], candidates: list[Candidate],
             fmt: str | None = None, log=print) -> None:
    """Each candidate once at each M and shape, eagerly, nothing timed: the launches for a
    profiler (``ncu -k regex:KERNEL python3 -m quarl bench sweep ... --once``)."""
    import torch

    fam = family(fam_name)
    dev = torch.device("cuda")
    for m in ms:
        for label, n, k in family_shapes(fam, shapes):
            b = _build(fam, fmt or fam.format, m, n, k, dev, l2=1)
            for cand in candidates:
                with _override(fam, cand):
                    b.calls[0]()
                torch.cuda.synchronize()
                log(f"ran M={m} {label} {format_candidate(cand)}")
            del b
            torch.cuda.empty_cache()


def trace_summary(trace: list[list[int]], sms: int) -> dict:
    """Per-block phases of one launch of the wgmma kernel's probe build (rows of 12 words,
    :data:`~quarl.quant.kernels.cuda_w4.TRACE_POINTS`: globaltimer ns in words 0-4, the SM in
    word 10; a point a block did not pass is 0). Phases per block: ``fill`` entry -> first group
    landed, ``loop`` -> main loop done, ``epilogue`` -> its last probe; medians and 90th
    percentiles in us. ``loop_clock_mhz``: the SM clock over the main loop (clock64 cycles,
    words 6-7, per globaltimer us), median and lowest. Per SM: blocks run and idle time (before
    its first block, between its blocks, after its last, within the launch's span), as a
    fraction of the span."""
    rows = [r for r in trace if r[0]]
    if not rows:
        raise ValueError("the trace holds no block: was the kernel built with W4_TRACE and launched?")
    t0 = min(r[0] for r in rows)
    ends = [max(r[0:5]) for r in rows]
    span = max(ends) - t0

    def stats(vals: list[float]) -> dict:
        if not vals:
            return dict(median_us=math.nan, p90_us=math.nan)
        v = sorted(vals)
        return dict(median_us=v[len(v) // 2] / 1e3, p90_us=v[min(len(v) - 1, (9 * len(v)) // 10)] / 1e3)

    fill = [r[1] - r[0] for r in rows if r[1]]
    loop = [r[2] - r[1] for r in rows if r[1] and r[2]]
    epi = [e - r[2] for r, e in zip(rows, ends) if r[2]]
    mhz = sorted(1e3 * (r[7] - r[6]) / (r[2] - r[1]) for r in rows if r[1] and r[2] > r[1] and r[7] > r[6])
    by_sm: dict[int, list[tuple[int, int]]] = {}
    for r, e in zip(rows, ends):
        by_sm.setdefault(int(r[10]), []).append((r[0], e))
    idle = []
    for sm in range(sms):
        spans = sorted(by_sm.get(sm, []))
        busy_to, gap = t0, 0
        for start, end in spans:
            gap += max(0, start - busy_to)
            busy_to = max(busy_to, end)
        idle.append((gap + (t0 + span - busy_to)) / span if span else 0.0)
    counts = [len(by_sm.get(sm, [])) for sm in range(sms)]
    return dict(blocks=len(rows), sms_used=len(by_sm), span_us=span / 1e3, fill=stats(fill), loop=stats(loop),
                epilogue=stats(epi),
                loop_clock_mhz=(dict(median=mhz[len(mhz) // 2], min=mhz[0]) if mhz
                                else dict(median=math.nan, min=math.nan)),
                blocks_per_sm=dict(min=min(counts), max=max(counts)),
                sm_idle_frac=dict(median=sorted(idle)[len(idle) // 2], max=max(idle)))


def trace_line(m: int, label: str, plan: str, s: dict) -> str:
    return (f"M={m} {label} {plan}: {s['blocks']} blocks on {s['sms_used']} SMs ({s['blocks_per_sm']['min']}-"
            f"{s['blocks_per_sm']['max']} each), span {s['span_us']:.1f} us; per block fill "
            f"{s['fill']['median_us']:.2f} / loop {s['loop']['median_us']:.2f} / epilogue "
            f"{s['epilogue']['median_us']:.2f} us (medians; p90 "
            f"{s['fill']['p90_us']:.2f} / {s['loop']['p90_us']:.2f} / {s['epilogue']['p90_us']:.2f}); loop at "
            f"{s['loop_clock_mhz']['median']:.0f} MHz (min {s['loop_clock_mhz']['min']:.0f}); SM idle "
            f"{100 * s['sm_idle_frac']['median']:.1f}% (max {100 * s['sm_idle_frac']['max']:.1f}%)")


def run_trace(fam_name: str, ms: list[int], shapes: list[tuple[str, int, int]], candidates: list[Candidate] | None,
              fmt: str | None = None, log=print, warmup: int = 3) -> dict:
    """Each wgmma candidate (the table's plan where None or where it is a wgmma plan) once with
    the kernel's timing probes, after ``warmup`` launches, at every M and shape: per-block
    phases and SM idle time (:func:`trace_summary`), and the blocks' raw probes."""
    import torch

    from quarl.bench.common import git_commit
    from quarl.quant.kernels import cuda_w4, dispatch
    from quarl.quant.kernels.device import num_sms
    from quarl.quant.kernels.w4_layout import RepackCache
    from quarl.quant.qweight import quantize_weight

    fam = family(fam_name)
    fmt = fmt or fam.format
    dev = torch.device("cuda")
    sms = num_sms(dev)
    result = dict(benchmark="sweep-trace", family=fam_name, format=fmt, device=torch.cuda.get_device_name(dev),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  git_commit=git_commit(), torch=torch.__version__, points=list(cuda_w4.TRACE_POINTS), rows=[])
    for m in ms:
        for label, n, k in family_shapes(fam, shapes):
            qw = quantize_weight(torch.randn(n, k, device=dev) * 0.02, fmt)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            plans = candidates if candidates is not None else [dispatch.pick(qw, m, dev)]
            for plan in plans:
                name = format_candidate(plan)
                if plan.kernel != "wgmma":
                    log(f"M={m} {label} {name}: not a wgmma plan, no probes (skipped)")
                    continue
                cache = RepackCache()
                for _ in range(warmup):
                    cuda_w4.wgmma_trace(x, qw, None, plan.config, cache)
                _, tr, grid = cuda_w4.wgmma_trace(x, qw, None, plan.config, cache)
                torch.cuda.synchronize()
                raw = tr.cpu().tolist()
                s = trace_summary(raw, sms)
                result["rows"].append(dict(M=m, layer=label, N=n, K=k, plan=name, grid=list(grid), summary=s,
                                           blocks=[r[:5] + [r[10]] for r in raw]))
                log(trace_line(m, label, name, s))
            del qw, x
            torch.cuda.empty_cache()
    return result
