"""The repository stands on its own: nothing points outside it, and every pitfall reference exists."""

import functools
import os
import re
from pathlib import Path

import pytest

from configs.paths import REPO_ROOT

TEXT_SUFFIXES = (".py", ".md", ".toml", ".txt")
PITFALL_REFERENCE = re.compile(r"docs/pitfalls\.md\s+#(\d+)")


@functools.cache
def repository_text_files() -> tuple[Path, ...]:
    """Text files outside hidden folders; those folders (.git, a .venv of thousands of files) are never walked."""
    found = []
    for folder, subfolders, files in os.walk(REPO_ROOT):
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        texts = [name for name in files if Path(name).suffix in TEXT_SUFFIXES and not name.startswith(".")]
        found += [Path(folder, name) for name in texts]
    return tuple(found)


@functools.cache
def text_of(path: Path) -> str:
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
