"""``compressed-tensors``: the low-bit policy in the format vLLM and transformers load.

The export holds the very codes the rollout engine ran on (for an ``aligned`` run: the
ones the learner's forward was trained against), packed with the ``compressed-tensors``
library's own packers (``pack_to_int32``, ``pack_fp4_to_uint8``) under the tensor names
its compressors define. Nothing is re-quantized: quarl's codes are moved, never rounded
again. Every quantized linear ``L`` of the run (``quant.include`` / ``quant.exclude``;
``layers.*`` by default) is stored as below (``N`` outputs, ``K`` inputs, ``G`` group
size; ``q`` signed codes, ``u`` quarl's unsigned ones, ``b`` bits):

=============  =====================  ================================================
scheme         format                 tensors of ``model.L``
=============  =====================  ================================================
w4a16          pack-quantized         ``weight_packed`` int32 ``[N, K/8]`` (``q = u - 8``,
                                      8 codes per word, dense), ``weight_scale`` fp32
                                      ``[N, K/128]``, ``weight_shape`` int64 ``[2]``
w4a16-asym     pack-quantized         the same plus ``weight_zero_point`` int32
                                      ``[N/8, K/128]`` (``z - 8``, packed along N)
w4a8-int8      int-quantized          ``weight`` int8 ``[N, K]`` (``q`` in [-8, 7]),
                                      ``weight_scale`` fp32 ``[N, K/128]``
w8a8-int8      int-quantized          ``weight`` int8 ``[N, K]``, ``weight_scale`` fp32 ``[N, 1]``
w8a8-fp8       float-quantized        ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale``
                                      fp32 ``[N, 1]``
nvfp4          nvfp4-pack-quantized   ``weight_packed`` uint8 ``[N, K/2]`` (e2m1, column
                                      ``2j`` in bits 0-3, ``2j+1`` in 4-7),
                                      ``weight_scale`` float8_e4m3fn ``[N, K/16]``,
                                      ``weight_global_scale`` fp32 ``[1]``
mxfp4          mxfp4-pack-quantized   ``weight_packed`` as nvfp4, ``weight_scale`` uint8
                                      ``[N, K/32]`` (e8m0 exponents)
=============  =====================  ================================================

W8A8 / W4A8 schemes also name their activations in ``config.json``: int8 or fp8,
per token, dynamic, symmetric (the runtime quantizes them; nothing is stored).
Embeddings, norms, biases and the LM head are bf16 under their HF names;
``quantization_config`` lists the unquantized linears under ``ignore``
(``["lm_head"]`` with the default ``quant.include``).

Exactness. The library's decompression gives back quarl's dequantized weight bit for
bit (:func:`quarl.quant.QuantizedWeight.dequantize` in fp32) for the int and fp8
formats (fp32 scales, ``(q - z) * s`` in fp32 on both sides) and for mxfp4 (products of
e2m1 values and powers of two are exact in the library's bf16). For nvfp4 the library
computes ``bf16(e2m1 * fp32(g / G))`` with a stored *divisor* ``G`` where quarl computes
``e2m1 * fp32(g * t)``; :func:`nvfp4_global_scale` picks the ``G`` (next to ``1 / t``)
for which every possible code and group scale decompresses to exactly
``QuantizedWeight.dequantize(torch.bfloat16)``, preferring one with ``fp32(1 / G) == t``
(the factor vLLM's kernels apply). Each layer is decompressed with the library and
compared at export time; a mismatch stops the export.

UAQ (``quant.uaq_scale = s``) is folded back, leaving a standard model: the norms before
q/k/v and gate/up are divided by ``s`` (in fp32) and the scales of those linears
multiplied by ``s`` (fp32 scales, or nvfp4's tensor scale), codes unchanged. mxfp4's
power-of-two scales can take only a power-of-two ``s``.

Qwen3-MoE. Each expert is stored as the three linears released checkpoints hold and vLLM's
compressed-tensors MoE loader reads (``model.layers.L.mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj``, the tensors of the table above under each). The codes are the
engine's (:class:`quarl.quant.experts.QuantExperts`, which ``quantize_model`` makes of the
experts ``quant.include`` / ``quant.exclude`` select by their module name
``layers.L.mlp.experts``): each projection quantized as its ``[E * N, K]`` view, which is every
expert quantized on its own, cut into per-expert row blocks (``QuantizedWeight.rows``), an
expert's ``gate_up_proj`` rows into its gate and up halves. Experts left unquantized are
stored per expert in bf16 and listed in ``ignore`` by their linears' names. The router
(``model.layers.L.mlp.gate``: a Linear in vLLM and in llm-compressor's view of the model, a
plain parameter holder in quarl and in transformers 5) stays bf16 and is always listed in
``ignore``, as compressed-tensors checkpoints of MoE models do. Folding UAQ takes the router
too (its input is the scaled norm's output: its weight is multiplied by ``s``), and the
experts' ``gate_up_proj`` scales. nvfp4 cannot quantize stacked experts (its per-tensor
scale; ``quantize_model`` says so): exclude them (``quant.exclude: ["layers.*.mlp.experts"]``).

Refused: ``bf16`` (nothing quantized: ``--format hf-bf16``) and ``w2a16`` (the library
can pack 2-bit codes, but vLLM's compressed-tensors integer kernels take 4- or 8-bit
weights only; ``--format quarl-packed`` keeps them), and any quantized linear whose
``K`` is not a multiple of the group size (compressed-tensors stores whole groups; quarl
pads K to 128).

vLLM keeps the scales of its integer kernels in the serving dtype, so it rounds the fp32
scales to bf16 when it loads them. quarl's group scales (w4a16, w4a16-asym, w4a8-int8) are
bf16 values already (:func:`quarl.quant.reference.bf16_scale`), so vLLM serves the very
weights the run trained, unless a UAQ scale that is not a power of two was folded into them.
transformers (CPU) decompresses with the library.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from quarl.export.hf import PolicyCheckpoint, expert_pieces, hf_tensors, metadata_header
from quarl.export.packed import quantized_policy
from quarl.io import atomic_path
from quarl.model.loading import normal_permissions
from quarl.model.moe import SparseMoeBlock
from quarl.quant import QuantizedWeight, QuantLinear, QuantScheme
from quarl.quant.experts import QuantExperts
from quarl.quant import reference as ref
from quarl.quant.uaq import ATTN_INPUTS, MLP_INPUTS

REST_DTYPE = torch.bfloat16
INSTALL = "pip install compressed-tensors"
_SERVED_INT_BITS = (4, 8)  # integer weight widths vLLM's compressed-tensors kernels take
_E4M3_FINITE = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # positive e4m3 values
_E2M1_NONZERO = torch.tensor(ref.E2M1_GRID[1:], dtype=torch.float32)


def _library():
    """The ``compressed_tensors`` module (imported here: quarl runs without it elsewhere)."""
    try:
        import compressed_tensors
    except ImportError as e:
        if e.name and e.name.split(".")[0] != "compressed_tensors":
            raise  # a dependency of the library is missing: the CLI names its install command
        raise ValueError(
            f"--format compressed-tensors needs the Python package compressed-tensors, which is not installed: "
            f"{INSTALL} (or pip install -e \".[train]\")"
        ) from e
    return compressed_tensors


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


# ----------------------------------------------------------------------------- scheme
def quantization_scheme(scheme: QuantScheme):
    """The ``compressed_tensors`` ``QuantizationScheme`` that stores ``scheme``'s codes
    exactly, its ``format`` inferred by the library; ValueError for schemes it cannot hold."""
    _library()
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if not scheme.quantizes_weights:
        raise ValueError(f"scheme {scheme.name} quantizes nothing; export it with --format hf-bf16")
    if scheme.weight_format == "int" and scheme.weight_bits not in _SERVED_INT_BITS:
        raise ValueError(
            f"scheme {scheme.name}: the compressed-tensors library can pack {scheme.weight_bits}-bit codes, but "
            f"vLLM's compressed-tensors integer kernels take 4- or 8-bit weights only, so the export would not "
            f"serve; use --format quarl-packed (the engine's own weights) or --format hf-bf16"
        )
    if scheme.weight_format == "fp4":
        # NVFP4A16 / MXFP4A16 in the library's presets: tensor-group e4m3 or group e8m0 scales.
        nv = scheme.scale_format == "e4m3"
        weights = QuantizationArgs(
            num_bits=4, type="float", symmetric=True, group_size=scheme.group_size,
            strategy="tensor_group" if nv else "group",
            scale_dtype=torch.float8_e4m3fn if nv else torch.uint8,
            zp_dtype=torch.float8_e4m3fn if nv else torch.uint8,
        )
    else:
        weights = QuantizationArgs(
            num_bits=scheme.weight_bits, type="int" if scheme.weight_format == "int" else "float",
            symmetric=scheme.symmetric, group_size=scheme.group_size,
            strategy="group" if scheme.group_size else "channel",
        )
    acts = None
    if scheme.quantizes_activations:
        acts = QuantizationArgs(num_bits=8, type="int" if scheme.act_format == "int8" else "float",
                                strategy="token", symmetric=True, dynamic=True)
    ct = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    ct.format = infer_module_format(nn.Linear, ct).value
    expected = _expected_format(scheme)
    if ct.format != expected:
        raise ValueError(f"scheme {scheme.name}: compressed-tensors {_library().__version__} stores it as "
                         f"{ct.format}, not {expected}; this quarl cannot export it exactly")
    return ct


def _expected_format(scheme: QuantScheme) -> str:
    if scheme.weight_format == "fp4":
        return "nvfp4-pack-quantized" if scheme.scale_format == "e4m3" else "mxfp4-pack-quantized"
    if scheme.weight_format == "fp8":
        return "float-quantized"
    # Int codes with quantized activations are stored one per int8 (vLLM's W8A8 / W4A8
    # loaders read ``weight``); weight-only int4 is packed (vLLM's WNA16 reads ``weight_packed``).
    return "int-quantized" if scheme.quantizes_activations else "pack-quantized"


# ---------------------------------------------------------------------------- UAQ fold
def scale_quantized(qw: QuantizedWeight, factor: float) -> QuantizedWeight:
    """The same codes standing for ``factor`` times the weight: the scales take the factor."""
    if factor == 1.0:
        return qw
    fmt, tensors = qw.scheme.scale_format, dict(qw.tensors())
    if fmt == "fp32":
        tensors["scales"] = qw.scales * factor
    elif fmt == "e4m3":
        tensors["global_scale"] = qw.global_scale * factor
    else:
        mantissa, exponent = math.frexp(factor)
        exps = qw.scales.to(torch.int32) + (exponent - 1)
        if mantissa != 0.5 or exps.min() < 1 or exps.max() > 254:
            raise ValueError(
                f"{qw.scheme.name} stores power-of-two (e8m0) scales, which cannot take the UAQ scale {factor} "
                "exactly; export this run with --format quarl-packed (UAQ kept) or --format hf-bf16"
            )
        tensors["scales"] = exps.to(torch.uint8)
    return QuantizedWeight(qw.scheme, qw.shape, **tensors)


@torch.no_grad()
def fold_uaq(model: nn.Module, scale: float) -> None:
    """Undo UAQ on a model whose linears may be :class:`QuantLinear` (and experts
    :class:`~quarl.quant.experts.QuantExperts`): norms divided by ``scale`` in fp32, the linears
    they feed multiplied (quantized ones through their scales). In a sparse layer those are the
    router and the experts' ``gate_up_proj``."""
    if scale == 1.0:
        return
    for layer in model.layers:
        norm = layer.input_layernorm
        norm.weight.data = norm.weight.float() / scale
        for name in ATTN_INPUTS:
            _scale_linear(getattr(layer.self_attn, name), scale)
        norm = layer.post_attention_layernorm
        norm.weight.data = norm.weight.float() / scale
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.gate.weight.data = layer.mlp.gate.weight.float() * scale
            experts = layer.mlp.experts
            if isinstance(experts, QuantExperts):
                experts.gate_up_proj.copy_from(scale_quantized(experts.gate_up_proj.packed, scale))
            else:
                experts.gate_up_proj.data = experts.gate_up_proj.float() * scale
            continue
        for name in MLP_INPUTS:
            _scale_linear(getattr(layer.mlp, name), scale)


def _scale_linear(linear: nn.Module, scale: float) -> None:
    if isinstance(linear, QuantLinear):
        folded = scale_quantized(linear.qweight, scale)
        for field, t in folded.tensors().items():
            setattr(linear, field, t)
    else:
        linear.weight.data = linear.weight.float() * scale


def expert_linears(name: str, experts: QuantExperts) -> list[tuple[str, QuantizedWeight]]:
    """``(module name, quantized weight)`` of each expert's three linears, in expert order: row
    blocks of the engine's ``[E * N, K]`` codes, the gate and up halves of the expert's
    ``gate_up_proj`` rows."""
    packed = experts.quantized_weights()
    gate_up, down = packed["gate_up_proj"], packed["down_proj"]
    i, h = experts.intermediate_size, experts.hidden_size
    out = []
    for e in range(experts.num_experts):
        out += [(f"{name}.{e}.gate_proj", gate_up.rows(2 * i * e, 2 * i * e + i)),
                (f"{name}.{e}.up_proj", gate_up.rows(2 * i * e + i, 2 * i * (e + 1))),
                (f"{name}.{e}.down_proj", down.rows(h * e, h * (e + 1)))]
    return out


# -------------------------------------------------------------------------- packing
def nvfp4_global_scale(tensor_scale: torch.Tensor) -> torch.Tensor:
    """The stored nvfp4 divisor ``G`` (fp32 ``[1]``) for quarl's tensor scale ``t``.

    Among the fp32 values next to ``1 / t``, the first for which the library's
    ``bf16(e2m1 * fp32(g / G))`` equals quarl's ``bf16(e2m1 * fp32(g * t))`` for every
    e2m1 magnitude and every finite e4m3 group scale ``g``, preferring one with
    ``fp32(1 / G) == t``."""
    t = tensor_scale.float().reshape(())
    want = (_E2M1_NONZERO[:, None] * (_E4M3_FINITE * t)[None]).to(torch.bfloat16)
    base = (1.0 / t).reshape(1).view(torch.int32)
    fallback = None
    for step in sorted(range(-64, 65), key=abs):
        g_div = (base + step).view(torch.float32)
        if torch.equal((_E2M1_NONZERO[:, None] * (_E4M3_FINITE / g_div)[None]).to(torch.bfloat16), want):
            if (1.0 / g_div) == t:
                return g_div
            fallback = g_div if fallback is None else fallback
    if fallback is None:
        raise ValueError(f"nvfp4 tensor scale {t.item()!r}: no fp32 divisor near 1/t reproduces quarl's weights "
                         "through compressed-tensors' decompression; export with --format quarl-packed")
    return fallback


def compress_weight(qw: QuantizedWeight, ct_scheme) -> dict[str, torch.Tensor]:
    """The tensors compressed-tensors stores for one quantized linear (local names:
    ``weight_packed``, ``weight_scale``, ...; the module docstring has the layouts)."""
    _library()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    scheme, (n, k), fmt = qw.scheme, qw.shape, ct_scheme.format
    g = scheme.group_size or k
    if k % g:
        raise ValueError(f"in_features {k} is not a multiple of {scheme.name}'s group size {g}: compressed-tensors "
                         "stores whole groups only")
    groups = k // g
    codes = qw.codes()  # [N, K]: unsigned ints, int8, or the raw bits of fp8 / e2m1
    out: dict[str, torch.Tensor] = {}
    if scheme.weight_format == "fp4":
        out["weight_packed"] = pack_fp4_to_uint8(ref.e2m1_to_float(codes))  # keeps the sign of -0 codes
        out["weight_scale"] = qw.scales[:, :groups].contiguous()  # e4m3 (nvfp4) or e8m0 bytes (mxfp4)
        if scheme.scale_format == "e4m3":
            out["weight_global_scale"] = nvfp4_global_scale(qw.global_scale)
    elif not scheme.packed:  # int8 / fp8 per output channel
        out["weight"] = qw.qdata.contiguous()
        out["weight_scale"] = qw.scales[:, None].contiguous()
    else:
        half = 2 ** (scheme.weight_bits - 1)
        signed = (codes.to(torch.int16) - half).to(torch.int8)  # the library's codes are centred on zero
        out["weight_scale"] = qw.scales[:, :groups].contiguous()
        if fmt == "pack-quantized":
            out["weight_packed"] = pack_to_int32(signed, scheme.weight_bits)
            out["weight_shape"] = torch.tensor([n, k])
        else:
            out["weight"] = signed.contiguous()
        if not scheme.symmetric:
            zeros = (qw.zeros[:, :groups].to(torch.int16) - half).to(torch.int8)
            out["weight_zero_point"] = pack_to_int32(zeros, scheme.weight_bits, packed_dim=0) \
                if fmt == "pack-quantized" else zeros.contiguous()
    names = set(BaseCompressor.get_value_from_registry(fmt).compression_param_names(ct_scheme))
    if set(out) != names:
        raise ValueError(f"compressed-tensors {_library().__version__} expects {sorted(names)} for {fmt}, "
                         f"this quarl writes {sorted(out)}")
    return out


def decompress_weight(tensors: dict[str, torch.Tensor], ct_scheme) -> torch.Tensor:
    """The library's dense weight for one linear's stored tensors."""
    _library()
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(ct_scheme.format).decompress(dict(tensors), ct_scheme)["weight"]


def expected_decompressed(qw: QuantizedWeight) -> torch.Tensor:
    """quarl's dequantized weight in the dtype the library decompresses this scheme to."""
    nvfp4 = qw.scheme.weight_format == "fp4" and qw.scheme.scale_format == "e4m3"
    return qw.dequantize(torch.bfloat16 if nvfp4 else torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit once widened to fp32 (exact from bf16; -0.0 differs from 0.0)."""
    return a.shape == b.shape and torch.equal(a.float().contiguous().view(torch.int32),
                                              b.float().contiguous().view(torch.int32))


# ---------------------------------------------------------------------------- export
def export_compressed(ckpt: PolicyCheckpoint, out: Path, scheme: QuantScheme, metadata: dict[str, Any]) -> list[str]:
    """Write ``ckpt``'s policy in ``scheme`` as a compressed-tensors checkpoint directory;
    returns the quantized module names (linears, and each quantized expert's three linears)."""
    _library()
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    ct_scheme = quantization_scheme(scheme)
    model, modules = quantized_policy(ckpt, scheme)
    ignore = ["lm_head"]  # the unquantized linears, and every MoE block's router
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and name != "lm_head":
            ignore.append(_hf_name(name))
        elif isinstance(mod, SparseMoeBlock):
            ignore.append(_hf_name(f"{name}.gate"))
    fold_uaq(model, ckpt.uaq_scale)
    quantized_fields = {f"{m}.{f}" for m in modules for f in model.get_submodule(m)._fields}
    tensors = {}
    for name, t in model.state_dict().items():
        if name in quantized_fields:
            continue
        for key, piece in hf_tensors(name, t.detach()):
            tensors[key] = piece.to(REST_DTYPE).contiguous()
            if expert_pieces(name, t) is not None:
                ignore.append(key.removesuffix(".weight"))  # an expert left unquantized
    linears: list[tuple[str, QuantizedWeight]] = []
    for name in modules:
        mod = model.get_submodule(name)
        linears += expert_linears(name, mod) if isinstance(mod, QuantExperts) else [(name, mod.qweight)]
    for name, qw in linears:
        try:
            stored = compress_weight(qw, ct_scheme)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if not _same_bits(decompress_weight(stored, ct_scheme), expected_decompressed(qw)):
            raise RuntimeError(f"{name}: compressed-tensors decompresses the export to other weights than quarl's "
                               f"{scheme.name} codes stand for; refusing to write it")
        tensors.update({f"{_hf_name(name)}.{key}": t for key, t in stored.items()})
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={**metadata_header(metadata), "format": "pt"})
        normal_permissions(tmp)
    config = ckpt.arch.to_hf_dict()
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    qconfig = QuantizationConfig(config_groups={"group_0": ct_scheme}, format=ct_scheme.format,
                                 quantization_status="compressed", ignore=ignore)
    ModelCompressor(quantization_config=qconfig).update_config(str(out))
    return [name for name, _ in linears]
