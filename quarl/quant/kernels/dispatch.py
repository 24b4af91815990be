"""Which kernel and config a quantized GEMM runs: one table per format family and GPU, decided once.

``plan = pick(qw, m, device, dtype)`` returns a typed :class:`Plan` (kernel name + config);
``plan.run(...)`` launches it. The tables are data (:mod:`.tables`): per family and GPU row
set (:data:`.device.GENS`) a tuple of rows, the first whose M range and conditions on the
dimensions match gives the plan. How the rows were chosen and measured: docs/kernels.md.

Sweeps replace a family's choice inside ``with overrides(family=plan_or_fn): ...``; nothing
here reads the environment.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator

import torch

from quarl.quant.kernels.act_quant import act_quant_config
from quarl.quant.kernels.config import TileConfig, WgConfig  # noqa: F401 (re-exported for sweeps and tests)
from quarl.quant.kernels.device import GENS, gpu_gen  # noqa: F401
from quarl.quant.kernels.plan import Plan
from quarl.quant.kernels.tables import DENSE_FIRST, DEQUANT, TABLES, first_match, rows_for  # noqa: F401
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import QuantScheme

_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("quarl_kernel_overrides", default={})


@contextlib.contextmanager
def overrides(**by_family) -> Iterator[None]:
    """Inside the block, :func:`pick` gives these instead of the tables' rows (sweeps, A/B
    runs): ``family=Plan`` (None for a gated family: no gated GEMM), or ``family=fn`` with
    ``fn(m, n, k) -> Plan | None``. ``act_quant=(block, warps)`` or ``fn(m, k)``."""
    unknown = set(by_family) - set(TABLES) - {"act_quant"}
    if unknown:
        raise ValueError(f"unknown kernel families {sorted(unknown)}; valid: {sorted(TABLES)} and act_quant")
    token = _OVERRIDES.set({**_OVERRIDES.get(), **by_family})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def family(scheme: QuantScheme) -> str:
    """The table a scheme's GEMM is picked from."""
    if scheme.act_format == "fp8":
        return "fp8"
    if scheme.act_format == "int8":
        return "w4a8" if scheme.packed else "int8"
    if scheme.weight_format == "int" and scheme.weight_bits == 4 and scheme.group_size == 128:
        return "w4a16"
    return "weight_only"


@functools.lru_cache(maxsize=4096)
def lookup(fam: str, gen: str, m: int, n: int, k: int, dense: bool = False) -> Plan | None:
    """The plan of the first row of table ``fam`` for GPU row set ``gen`` that matches
    (``dense``: the weight has a dense copy, whose rows of :data:`DENSE_FIRST` come first)."""
    row = first_match((rows_for(DENSE_FIRST, fam, gen) if dense else ()) + rows_for(TABLES, fam, gen), m, n, k)
    if row is None:  # (every table ends in a catch-all)
        raise LookupError(f"no row of {fam} matches gen={gen} m={m} n={n} k={k}")
    return row.plan


def _choose(fam: str, gen: str, m: int, n: int, k: int, dense: bool = False) -> Plan | None:
    ov = _OVERRIDES.get().get(fam, lookup)
    if ov is lookup:
        return lookup(fam, gen, m, n, k, dense)
    return ov(m, n, k) if callable(ov) else ov


def pick(qw: QuantizedWeight, m: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
         dense: bool = False) -> Plan:
    """The GEMM plan for ``m`` rows of activations of ``dtype`` on ``device`` (for schemes that
    quantize activations: the GEMM on their codes). ``dense``: the weight's owner keeps a
    dense copy of it (the ``dequant`` plan is then a plain GEMM on that copy)."""
    n, k = qw.shape
    fam = family(qw.scheme)
    return _choose(fam, gpu_gen(device, dtype) if fam == "w4a16" else "none", m, n, k, dense)


def gated_plan(act_format: str, m: int, n: int, k: int) -> Plan | None:
    """The gated GEMM plan for a W8A8 ``[gate; up]`` weight of ``n`` rows, or None (the plain
    GEMM and a separate SiLU-and-mul)."""
    return _choose("gated_" + act_format, "none", m, n, k)


def pick_gated(qw: QuantizedWeight, m: int) -> Plan | None:
    return gated_plan(qw.scheme.act_format, m, *qw.shape)


def pick_gated_w4(qw: QuantizedWeight, m: int, device: torch.device, dense: bool = False) -> Plan | None:
    """The plain w4a16 plan for ``m`` rows when the gated epilogue may run it (table
    ``gated_w4a16`` allows and the plan is the wgmma kernel), else None."""
    n, k = qw.shape
    if family(qw.scheme) != "w4a16" or _choose("gated_w4a16", gpu_gen(device, torch.bfloat16), m, n, k) is None:
        return None
    plan = pick(qw, m, device, torch.bfloat16, dense)
    return plan if plan.kernel == "wgmma" else None


def act_quant_plan(m: int, k: int) -> tuple[int, int]:
    """(columns per block, warps) of the activation quantizer."""
    ov = _OVERRIDES.get().get("act_quant")
    if ov is None:
        return act_quant_config(k)
    return ov(m, k) if callable(ov) else ov
