"""The docs' configuration reference and accelerate mapping are the ones the code generates; the module map
names every module."""

import re
from pathlib import Path

from scripts.config_reference import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "configuration.md"
ECOSYSTEM = ROOT / "docs" / "ecosystem.md"
DEVELOPMENT = ROOT / "docs" / "development.md"


def test_docs_config_reference_matches_the_dataclasses():
    assert reference_markdown() in CONFIGURATION.read_text(encoding="utf-8"), (
        "docs/configuration.md's reference is stale: paste `python scripts/config_reference.py` into it"
    )


def test_docs_accelerate_mapping_is_the_one_the_code_applies():
    from configs.accelerate_env import mapping_markdown

    assert mapping_markdown() in ECOSYSTEM.read_text(encoding="utf-8"), (
        "docs/ecosystem.md's accelerate mapping is stale: paste configs.accelerate_env.mapping_markdown() into it"
    )


def test_every_field_is_documented():
    from configs.cli import field_specs

    for spec in field_specs():
        assert len(spec.help) > 20, f"--{spec.name} needs a real description"


def layout_section() -> str:
    text = DEVELOPMENT.read_text(encoding="utf-8")
    return text[text.index("## Layout\n") : text.index("## Errors\n")]


def test_docs_layout_maps_every_module_and_only_existing_ones():
    root = ROOT
    named = set(re.findall(r"`((?:configs|policies|utils)/[\w/]+\.py|T5_training\.py|summarization_dataset\.py)`",
                           layout_section()))  # fmt: skip
    existing = {
        str(path.relative_to(root))
        for folder in ("configs", "policies", "utils")
        for path in (root / folder).rglob("*.py")
        if path.name != "__init__.py"
    } | {"T5_training.py", "summarization_dataset.py"}
    assert named == existing, {"missing from the Layout": existing - named, "not in the code": named - existing}
