"""What the README and docs/ name exists in the code: every registered fault has its row with its verdict, every
seam the architecture names is one, and the README's layout names every module. Users read these lists to
find what the harness catches and where it lives."""

from __future__ import annotations

import re
from pathlib import Path

from harness.faults import FAULTS
from reference_impl.seams import SEAMS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(text: str, start: str, end: str) -> str:
    """The part of `text` from the first `start` to the next `end` after it."""
    at = text.index(start) + len(start)
    return text[at : text.index(end, at)]


def test_the_readme_fault_table_has_every_registered_fault_with_its_verdict() -> None:
    table = _section(README, "| fault | what it does | verdict |", "\n\n")
    rows = dict(re.findall(r"^\| `(\w+)` \| .* \| ([A-Z_]+)[^|]* \|$", table, re.MULTILINE))
    assert sorted(rows) == sorted(FAULTS), "README's fault table and harness.faults.FAULTS differ"
    assert {n: v for n, v in rows.items() if v != FAULTS[n].expect} == {}


def test_every_seam_the_architecture_names_is_a_seam() -> None:
    text = _section((ROOT / "docs" / "architecture.md").read_text(), "## Seams and faults", "Faults")
    named = re.findall(r"`(\w+)`", _section(text, "(", ")"))
    assert named and [n for n in named if n not in SEAMS] == []


def test_the_readme_layout_names_every_module() -> None:
    block = _section(README[README.index("## Layout") :], "```", "```")
    words = set(re.findall(r"\w+", block))
    modules = [
        p.relative_to(ROOT)
        for package in ("harness", "reference_impl")
        for p in (ROOT / package).rglob("*.py")
        if not p.stem.startswith("__") and p.parent.name != "families"  # families: `families/<model_type>.py`
    ]
    assert modules and [str(m) for m in modules if m.stem not in words] == []
