"""Facts the docs state about the tree: the C++ op list, bullets said once, files named that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_architecture_lists_every_csrc_ops_source():
    text = (REPO / "docs" / "architecture.md").read_text()
    line = next(row for row in text.splitlines() if row.startswith("csrc/ops/ "))
    named = set(re.findall(r"[a-z_0-9]+", line.split(None, 1)[1]))
    sources = {path.stem for path in (REPO / "csrc" / "ops").glob("*.cpp")}
    assert sources <= named, f"docs/architecture.md's csrc/ops/ line misses {sorted(sources - named)}"


def test_no_bullet_is_said_twice():
    for doc in DOCS:
        openings = [line[:60] for line in doc.read_text().splitlines() if line.startswith("- ")]
        repeated = {o for o in openings if openings.count(o) > 1}
        assert not repeated, f"{doc.name} repeats the bullets {sorted(repeated)}"


def test_every_markdown_file_named_in_backticks_exists():
    for doc in DOCS:
        for name in re.findall(r"`([A-Za-z0-9_./-]+\.md)`", doc.read_text()):
            candidates = [REPO / name, REPO / "docs" / name, doc.parent / name]
            assert any(c.exists() for c in candidates), f"{doc.name} names {name}, which is not in the tree"


def test_the_quick_starts_test_command_reuses_the_first_commands_build():
    """Installing from the checkout builds routemm again; only the first quick-start command may."""
    text = (REPO / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    first, second = re.findall(r"```bash\n(.*?)```", text, re.S)[:2]
    assert 'pip install ".[test]"' in first and "routemm demo" in first
    assert "pip install" not in second and "bash tests/run.sh" in second
