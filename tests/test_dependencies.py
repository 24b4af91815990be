"""pyproject.toml's extras cover what the package imports, and a missing one says how to install it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from quarl.cli.main import OPTIONAL

ROOT = Path(__file__).resolve().parents[1]
# Import name -> distribution, where they differ.
DIST = {"yaml": "pyyaml", "math_verify": "math-verify", "compressed_tensors": "compressed-tensors"}
CORE = {"torch", "triton", "numpy", "yaml", "safetensors", "tokenizers"}
OPT_IN = {"wandb"}  # trainer.wandb_project: its own extra, an account, and its own "pip install wandb" error


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def _third_party_imports() -> dict[str, str]:
    """Top-level module -> one file of quarl/ importing it (``torch.utils.tensorboard`` counts as tensorboard)."""
    found = {}
    for file in sorted((ROOT / "quarl").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = "tensorboard" if name.startswith("torch.utils.tensorboard") else name.split(".")[0]
                if top != "quarl" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(file.relative_to(ROOT)))
    return found


def test_train_extra_lists_every_imported_package():
    project = _project()
    core, extras = _names(project["dependencies"]), project["optional-dependencies"]
    train = _names(extras["train"])
    imports = _third_party_imports()
    assert {"transformers", "pyarrow", "math_verify", "tensorboard", "rich", "matplotlib"} <= set(imports)
    for module, file in imports.items():
        dist = DIST.get(module, module)
        if module in CORE:
            assert module == "triton" or dist in core, f"{module} (imported by {file}) is missing from dependencies"
        elif module in OPT_IN:
            assert dist in _names(extras[module]), f"{module} needs its own extra"
        else:
            assert dist in train, f"{file} imports {module}: add {dist} to the train extra"
            assert OPTIONAL.get(module) == dist, f"add {module} to quarl.cli.main.OPTIONAL"


def test_test_extra_is_train_plus_test_tools():
    """The test extra names the train extra instead of copying its list (the two cannot drift apart),
    plus the test tools; the README's main command installs the train extra alone."""
    extras = _project()["optional-dependencies"]
    assert sorted(extras["test"]) == ["pytest", "pytest-xdist", "quarl[train]", "ruff", "triton"]
    assert "triton" not in _names(extras["train"])  # the CPU demo runs without it (tests/cli/test_cli.py)


def test_missing_transformers_names_the_install_command(tmp_path, monkeypatch):
    from quarl.tasks.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match=r'needs transformers, which is not installed: pip install -e "\.\[train\]"'):
        load_tokenizer(tmp_path)


def test_cli_turns_a_missing_optional_package_into_the_install_command():
    # rich is imported by `quarl train` once the config is loaded: hide it and run one step
    code = ("import sys; sys.modules['rich'] = None; from quarl.cli.main import main; "
            "sys.exit(main(['train', '--trainer.steps=1', '--trainer.run_dir=unused']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ('quarl train: error: this needs the Python package rich, which is not installed: '
                                'pip install -e ".[train]"')
    assert not (ROOT / "unused").exists()
