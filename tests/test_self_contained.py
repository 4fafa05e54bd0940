"""The repository stands on its own: nothing points outside it, and every pitfall reference exists."""

import re

import pytest

from configs.paths import REPO_ROOT

PITFALL_REFERENCE = re.compile(r"docs/pitfalls\.md\s+#(\d+)")


def repository_text_files() -> list:
    return [p for p in REPO_ROOT.rglob("*") if p.suffix in (".py", ".md", ".toml", ".txt") and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(REPO_ROOT).parts)]  # fmt: skip


def text_of(path) -> str:
    """The file's text; a file in another encoding (the Latin-1 FinancialPhraseBank sample) is searched too."""
    return path.read_text(encoding="utf-8", errors="replace")


@pytest.mark.parametrize("pattern", [r"\.\./shared", r"PITFALLS\s+item", r"PITFALLS\.md"])
def test_nothing_points_outside_the_repository(pattern):
    found = [str(p.relative_to(REPO_ROOT)) for p in repository_text_files() if re.search(pattern, text_of(p))]
    assert not found, found


def test_every_pitfall_reference_names_an_entry():
    entries = set(re.findall(r"^(\d+)\. \*\*", (REPO_ROOT / "docs" / "pitfalls.md").read_text(), re.M))
    assert len(entries) >= 20
    for path in repository_text_files():
        for number in PITFALL_REFERENCE.findall(text_of(path)):
            assert number in entries, f"{path.relative_to(REPO_ROOT)} cites docs/pitfalls.md #{number}"
