"""The README's configuration reference is the one the code generates."""

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
