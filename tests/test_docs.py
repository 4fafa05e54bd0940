"""The README's configuration reference is the one the code generates."""

import re
from pathlib import Path

from scripts.config_reference import reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_matches_the_dataclasses():
    assert reference_markdown() in README.read_text(encoding="utf-8"), (
        "README.md's configuration reference is stale: paste `python scripts/config_reference.py` into it"
    )


def test_every_field_is_documented():
    from configs.cli import field_specs

    for spec in field_specs():
        assert len(spec.help) > 20, f"--{spec.name} needs a real description"


def layout_section() -> str:
    text = README.read_text(encoding="utf-8")
    return text[text.index("## Layout\n") : text.index("## Errors\n")]


def test_readme_layout_maps_every_module_and_only_existing_ones():
    root = README.parent
    named = set(re.findall(r"`((?:configs|policies|utils)/[\w/]+\.py|T5_training\.py|summarization_dataset\.py)`",
                           layout_section()))  # fmt: skip
    existing = {
        str(path.relative_to(root))
        for folder in ("configs", "policies", "utils")
        for path in (root / folder).rglob("*.py")
        if path.name != "__init__.py"
    } | {"T5_training.py", "summarization_dataset.py"}
    assert named == existing, {"missing from README": existing - named, "not in the code": named - existing}
