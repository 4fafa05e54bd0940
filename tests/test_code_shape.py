"""The product code's shape: small functions, and no comment pointing outside the repository."""

import ast
import re

import pytest

from utils.paths import REPO_ROOT

PRODUCT = ["T5_training.py", "summarization_dataset.py", "configs", "policies", "utils"]
MAX_LINES = 50
MAX_PARAMETERS = 6  # self and cls not counted, as ruff's PLR0913 counts
PITFALL_REFERENCE = re.compile(r"docs/pitfalls\.md\s+#(\d+)")


def product_files() -> list:
    files = []
    for root in PRODUCT:
        path = REPO_ROOT / root
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def functions():
    for file in product_files():
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield file.relative_to(REPO_ROOT), node


def parameter_count(node: ast.FunctionDef) -> int:
    args = node.args
    names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return len([name for name in names if name not in ("self", "cls")])


def test_the_product_code_is_found():
    assert len(product_files()) > 30 and len(list(functions())) > 150


def test_no_function_is_longer_than_50_lines():
    long = [f"{file}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for file, node in functions() if node.end_lineno - node.lineno + 1 > MAX_LINES]  # fmt: skip
    assert not long, long


def test_no_function_takes_more_than_6_parameters():
    wide = [f"{file}:{node.lineno} {node.name} ({parameter_count(node)})"
            for file, node in functions() if parameter_count(node) > MAX_PARAMETERS]  # fmt: skip
    assert not wide, wide


def repository_text_files() -> list:
    return [p for p in REPO_ROOT.rglob("*") if p.suffix in (".py", ".md", ".toml", ".txt") and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(REPO_ROOT).parts)]  # fmt: skip


@pytest.mark.parametrize("pattern", [r"\.\./shared", r"PITFALLS\s+item", r"PITFALLS\.md"])
def test_nothing_points_outside_the_repository(pattern):
    found = [str(p.relative_to(REPO_ROOT)) for p in repository_text_files() if re.search(pattern, p.read_text())]
    assert not found, found


def test_every_pitfall_reference_names_an_entry():
    entries = set(re.findall(r"^(\d+)\. \*\*", (REPO_ROOT / "docs" / "pitfalls.md").read_text(), re.M))
    assert len(entries) >= 20
    for path in repository_text_files():
        for number in PITFALL_REFERENCE.findall(path.read_text()):
            assert number in entries, f"{path.relative_to(REPO_ROOT)} cites docs/pitfalls.md #{number}"
