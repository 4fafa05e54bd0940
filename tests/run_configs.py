"""A RunConfig from field overrides, each placed in its own section: field names are unique across the
sections (tests/test_cli.py checks it), so tests name fields as the command line does, without sections."""

import dataclasses

from configs.cli import field_specs
from configs.run import RunConfig


def run_config(**overrides) -> RunConfig:
    """RunConfig() with `overrides` ({field: value}, any section) applied; an unknown field is a TypeError."""
    section_of = {spec.name: spec.section for spec in field_specs()}
    unknown = sorted(set(overrides) - set(section_of))
    if unknown:
        raise TypeError(f"no config field named {', '.join(unknown)}")
    config = RunConfig()
    by_section: dict[str, dict] = {}
    for name, value in overrides.items():
        by_section.setdefault(section_of[name], {})[name] = value
    return dataclasses.replace(
        config,
        **{
            section: dataclasses.replace(getattr(config, section), **values)
            for section, values in by_section.items()
        },
    )
