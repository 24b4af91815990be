"""`quarl export --format compressed-tensors`: the library decompresses it to quarl's weights,
transformers loads it, config.json says what vLLM reads, and unexportable schemes are refused."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quarl.export import export_checkpoint
from quarl.export.compressed import (
    compress_weight, decompress_weight, fold_uaq, nvfp4_global_scale, quantization_scheme,
)
from quarl.quant import QATLinear, QuantizedWeight, apply_uaq, get_scheme, quantize_model, quantize_weight
from tests.export.test_export import _make_run, _original

pytest.importorskip("compressed_tensors")

EXPORTED = ("w4a16", "w4a16-asym", "w4a8-int8", "w8a8-int8", "w8a8-fp8", "nvfp4", "mxfp4")
# the library's own preset for each scheme, and the format it stores it in
PRESETS = {
    "w4a16": ("W4A16", "pack-quantized"), "w4a16-asym": ("W4A16_ASYM", "pack-quantized"),
    "w4a8-int8": ("W4A8", "int-quantized"), "w8a8-int8": ("W8A8", "int-quantized"),
    "w8a8-fp8": ("FP8_DYNAMIC", "float-quantized"), "nvfp4": ("NVFP4A16", "nvfp4-pack-quantized"),
    "mxfp4": ("MXFP4A16", "mxfp4-pack-quantized"),
}
IDS = torch.tensor([[5, 17, 99, 3, 42, 64, 7, 120], [1, 2, 3, 4, 5, 6, 7, 8]])


def _run(tmp_path: Path, scheme: str, uaq: float = 1.0, mode: str = "aligned") -> tuple[Path, torch.nn.Module]:
    """A run of the 0.8M built-in model (K = 128 / 384: whole int4 groups), and its original weights."""
    original = _original("small")
    return _make_run(tmp_path / f"run-{scheme}", original, mode=mode, scheme=scheme, uaq=uaq,
                     builtin="small"), original


def _trained(original: torch.nn.Module, scheme: str, uaq: float) -> torch.nn.Module:
    """The policy as the learner ran it: UAQ applied, QATLinear (its codes are what training saw)."""
    policy = copy.deepcopy(original)
    if uaq != 1.0:
        apply_uaq(policy, uaq)
    quantize_model(policy, scheme, QATLinear)
    return policy


def _stored(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Tensors of model.safetensors grouped by module (HF name -> local name -> tensor)."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for key in f.keys():
            module, _, local = key.rpartition(".")
            grouped.setdefault(module, {})[local] = f.get_tensor(key)
    return grouped


def _unscaled(qw: QuantizedWeight, s: float) -> QuantizedWeight:
    """``qw`` with UAQ's ``1 / s`` taken out of its scales (codes untouched), computed here by hand."""
    t = dict(qw.tensors())
    if qw.scheme.scale_format == "fp32":
        t["scales"] = qw.scales * s
    elif qw.scheme.scale_format == "e4m3":
        t["global_scale"] = qw.global_scale * s
    else:
        assert s == 1.0
    return QuantizedWeight(qw.scheme, qw.shape, **t)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def test_schemes_are_the_library_presets():
    from compressed_tensors.quantization import preset_name_to_scheme

    for name, (preset, fmt) in PRESETS.items():
        ours = quantization_scheme(get_scheme(name))
        theirs = preset_name_to_scheme(preset, ["Linear"])
        assert ours.weights == theirs.weights, name
        assert ours.input_activations == theirs.input_activations, name
        assert ours.format == fmt, name


@pytest.mark.parametrize("scheme, why", [("bf16", "--format hf-bf16"), ("w2a16", "4- or 8-bit weights only")])
def test_unexportable_schemes_are_refused(tmp_path, scheme, why):
    with pytest.raises(ValueError, match=why):
        quantization_scheme(get_scheme(scheme))
    run, _ = _run(tmp_path, "w4a16")
    with pytest.raises(ValueError, match=why):
        export_checkpoint(run, tmp_path / "out", "compressed-tensors", scheme=scheme)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-w4a16"]  # refused before writing anything


@pytest.mark.parametrize("scheme, uaq", [(s, 1.0) for s in EXPORTED] + [(s, 1.5) for s in EXPORTED if s != "mxfp4"])
def test_library_decompresses_to_the_trained_codes(tmp_path, scheme, uaq):
    run, original = _run(tmp_path, scheme, uaq)
    export_checkpoint(run, tmp_path / "ct", "compressed-tensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    ct_scheme = quantization_scheme(get_scheme(scheme))
    assert config["config_groups"]["group_0"]["format"] == ct_scheme.format
    stored, trained = _stored(tmp_path / "ct"), _trained(original, scheme, uaq)
    checked = 0
    for name, mod in trained.named_modules():
        if not isinstance(mod, QATLinear):
            continue
        fed_by_a_norm = name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        qw = _unscaled(mod.quantized_weight(), uaq if fed_by_a_norm else 1.0)  # trained codes, UAQ folded
        got = decompress_weight(stored[f"model.{name}"], ct_scheme)
        if scheme == "nvfp4":  # the library decompresses nvfp4 to bf16: quarl's weights rounded once
            assert got.dtype == torch.bfloat16
            want = qw.dequantize(torch.bfloat16)
        else:
            want = qw.dequantize(torch.float32)
            got = got.float()  # mxfp4: exact bf16 values
        assert torch.equal(_bits(got), _bits(want)), name  # bit for bit, signed zeros included
        checked += 1
    assert checked == 4 * 7
    norm = stored["model.layers.0.input_layernorm"]["weight"]
    assert torch.equal(norm, original.layers[0].input_layernorm.weight.bfloat16())  # UAQ gone from the norms


@pytest.mark.parametrize("scheme", EXPORTED)
def test_stored_codes_and_layout_are_the_library_compressors(scheme):
    """Our tensors are what the library's own compressor writes from quarl's weight and scales,
    and the codes in them are quarl's, bit for bit."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    sch = get_scheme(scheme)
    w = torch.randn(96, 256) * 0.05
    w[:, :8] = -1e-6  # tiny negatives: e2m1 / e4m3 codes of -0
    qw = quantize_weight(w, sch)
    ct_scheme = quantization_scheme(sch)
    ours = compress_weight(qw, ct_scheme)
    # the library's compressor, given quarl's dequantized weight and scales in its conventions
    state = {"weight": qw.dequantize(torch.float32), "weight_scale": ours["weight_scale"].float()}
    if scheme == "nvfp4":
        state["weight_global_scale"] = ours["weight_global_scale"]
    if scheme == "mxfp4":
        state["weight_scale"] = 2.0 ** (ours["weight_scale"].float() - 127)
    if not sch.symmetric:
        state["weight_zero_point"] = (qw.zeros.to(torch.int16) - 8).to(torch.int8)
    theirs = BaseCompressor.get_value_from_registry(ct_scheme.format).compress(state, ct_scheme)
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert (ours[key].dtype, ours[key].shape) == (theirs[key].dtype, theirs[key].shape), key
        if sch.weight_format != "fp4" or key != "weight_packed":
            assert torch.equal(ours[key], theirs[key]), key

    codes = qw.codes()  # quarl's: unsigned int4, int8, or the raw bits of e4m3 / e2m1
    if sch.weight_format == "fp4":
        packed = ours["weight_packed"]
        assert torch.equal(torch.stack([packed & 0xF, packed >> 4], dim=-1).view(96, 256), codes)
        # the library's quantizer loses the sign of zero codes (torch.sign(-0.0) is 0); ours keep it
        assert (codes == 8).any()
        assert torch.equal(theirs["weight_packed"] & 0x77, packed & 0x77)
    elif "weight_packed" in ours:
        signed = unpack_from_int32(ours["weight_packed"], 4, torch.Size([96, 256]))
        assert torch.equal(signed.to(torch.int16) + 8, codes.to(torch.int16))
    elif sch.weight_format == "fp8":
        assert torch.equal(ours["weight"].view(torch.uint8), codes)
    else:  # int8 codes, or int4 codes held one per int8 (w4a8-int8)
        assert torch.equal(ours["weight"].to(torch.int16), codes.to(torch.int16) - (8 if sch.packed else 0))
