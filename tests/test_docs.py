"""The README and docs/: a reference page for every command, links that resolve, and dated
figures kept to docs/performance.md."""

import re
from pathlib import Path

import typer

from blockscope.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    heads = re.findall(r"^#+\s+(.*)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_command_has_its_reference_page():
    names = sorted(typer.main.get_command(app).commands)
    assert len(names) >= 19
    missing = [n for n in names if not (ROOT / "docs" / "commands" / f"{n}.md").is_file()]
    assert missing == []


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md"
                                     and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_readme_is_short_and_dates_live_only_in_performance():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250
    dated = [str(p.relative_to(ROOT)) for p in PAGES if p.name != "performance.md"
             and re.search(r"\b20\d\d-\d\d-\d\d\b", p.read_text(encoding="utf-8"))]
    assert dated == []
