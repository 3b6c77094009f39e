"""Every ```python block of README.md and docs/*.md runs, each on its own in a fresh interpreter.

A block that needs something a plain test install may lack says so in its first lines with a
comment `# requires: NAME[, NAME]`: a module name (skipped when it cannot be imported) or a backend
(`cuda`, `metal`: skipped when routemm cannot open it). Nothing else is skipped, and a block that is
not self-contained fails here as it would for a reader who pasted it.

The knob tables in the docs must also be the one the code prints (`python -m routemm knobs`).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import routemm
from routemm import env

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BACKENDS = {name for name, _, _ in routemm.backend_status()}

_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_REQUIRES = re.compile(r"^#\s*requires:\s*(.+)$", re.M)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block of a Markdown file."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def _snippets():
    params = []
    for path in DOCS:
        for line, code in python_blocks(path):
            name = f"{path.relative_to(REPO)}:{line}"
            params.append(pytest.param(code, id=name))
    return params


def _missing_requirement(code: str) -> str | None:
    header = "\n".join(code.splitlines()[:3])
    for match in _REQUIRES.finditer(header):
        for need in (n.strip() for n in match.group(1).split(",")):
            if need in BACKENDS:
                if need not in routemm.available_backends():
                    return f"needs the {need} backend, unavailable here"
            elif importlib.util.find_spec(need) is None:
                return f"needs the {need} module, not installed here"
    return None


def test_the_docs_have_python_blocks():
    assert len(_snippets()) >= 5
    readme = python_blocks(REPO / "README.md")
    assert len(readme) >= 3  # NumPy, torch and GGUF


@pytest.mark.parametrize("code", _snippets())
def test_snippet_runs(code, tmp_path):
    reason = _missing_requirement(code)
    if reason:
        pytest.skip(reason)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"snippet failed:\n{code}\n--- stderr:\n{result.stderr}"


def test_requirement_markers_are_read():
    assert _missing_requirement("# requires: no_such_module_here\nimport no_such_module_here\n")
    assert _missing_requirement("import sys\n") is None
    if "metal" not in routemm.available_backends():
        assert "metal backend" in _missing_requirement("# requires: metal\n")


def test_a_failing_snippet_fails(tmp_path):
    (tmp_path / "README.md").write_text("text\n\n```python\nundefined_name\n```\n")
    ((line, code),) = python_blocks(tmp_path / "README.md")
    assert line == 4 and code == "undefined_name\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "NameError" in result.stderr


def test_knob_tables_in_the_docs_are_the_code_s():
    table = env.table_markdown()
    header = table.splitlines()[0]
    found = 0
    for path in DOCS:
        text = path.read_text()
        start = text.find(header)
        while start != -1:
            block = text[start:].split("\n\n", 1)[0].strip()
            assert block == table, f"{path.relative_to(REPO)}: the knob table differs from `python -m routemm knobs`"
            found += 1
            start = text.find(header, start + 1)
    assert found >= 1


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_in_the_docs_resolve():
    """README.md, docs/ and every Markdown file under bench/ (its map, results tables and records)."""
    broken = []
    for path in DOCS + sorted((REPO / "bench").rglob("*.md")):
        for target in _LINK.findall(path.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            if not (path.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{path.relative_to(REPO)} -> {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
