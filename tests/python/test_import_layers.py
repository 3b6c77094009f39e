"""The package's layers (the import-linter contract in pyproject.toml, docs/architecture.md): the
contract holds on a copy of the package and breaks on the same copy with one upward import seeded,
and the layers take nothing from the package root but the compiled extension.

The copy is renamed (routemm_copy) so that the linter reads it, not an installed routemm."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import routemm

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(routemm.__file__).resolve().parent
COPY = "routemm_copy"
LAYERS = ("core", "formats", "ops", "plans", "models", "integrations", "cli")
# The modules CMake installs beside the sources (compiled, or generated at build time).
BUILT = {"_core", "_torch_ops", "_torch_ops_build"}


def _contract() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = config["contracts"]
    assert config["root_package"] == "routemm" and contract["type"] == "layers"
    return contract


def _copy_package(tmp_path: Path) -> Path:
    root = tmp_path / "src" / COPY
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return root


def _lint(tmp_path: Path) -> subprocess.CompletedProcess:
    """lint-imports over the copy, with pyproject.toml's contract renamed to it."""
    pytest.importorskip("importlinter")
    contract = _contract()

    def renamed(text: str) -> str:
        return text.replace("routemm", COPY)

    lines = ["[importlinter]", f"root_package = {COPY}", "", "[importlinter:contract:layers]"]
    lines += [f"name = {contract['name']}", "type = layers", f"containers = {renamed(contract['containers'][0])}"]
    lines += ["layers ="] + [f"    {layer}" for layer in contract["layers"]]
    lines += ["ignore_imports ="] + [f"    {renamed(i)}" for i in contract.get("ignore_imports", [])]
    config = tmp_path / "importlinter.ini"
    config.write_text("\n".join(lines) + "\n")
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", command, "--config", str(config), "--no-cache"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "src"), "PATH": "/usr/bin:/bin"},
    )


def test_the_layers_contract_holds_on_a_copy_of_the_package(tmp_path):
    _copy_package(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_the_layers_contract_breaks_on_a_seeded_upward_import(tmp_path):
    """A lazy import of a higher layer (formats reaching ops) is an upward import too."""
    root = _copy_package(tmp_path)
    gguf_io = root / "formats" / "gguf_io.py"
    gguf_io.write_text(gguf_io.read_text() + "\n\ndef _seeded():\n    from ..ops import moe\n\n    return moe\n")
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout
    assert f"{COPY}.formats is not allowed to import {COPY}.ops" in result.stdout


def _root_imports(root: Path) -> list[tuple[str, str]]:
    """(module, name) of every name that a module of a layer takes from the package root (`from ..
    import name`, `from routemm import name`, `import routemm`) other than the built modules: the
    linter reads all of them as imports of the root package itself, which its contract ignores."""
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            depth = len(path.parent.relative_to(root).parts)  # `from ..` at depth 1 names the root
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found += [(str(path), a.name) for a in node.names if a.name == root.name]
                elif isinstance(node, ast.ImportFrom):
                    to_root = (node.level == depth + 1 and not node.module) or (
                        node.level == 0 and node.module == root.name
                    )
                    if to_root:
                        found += [(str(path), a.name) for a in node.names if a.name not in BUILT]
    return found


def test_the_layers_take_only_the_built_modules_from_the_package_root():
    assert _root_imports(PACKAGE) == []


def test_an_import_of_the_package_root_is_found(tmp_path):
    root = _copy_package(tmp_path)
    moe = root / "ops" / "moe.py"
    moe.write_text(moe.read_text() + "\n\ndef _seeded():\n    from .. import MoeLayer\n\n    return MoeLayer\n")
    assert _root_imports(root) == [(str(moe), "MoeLayer")]
