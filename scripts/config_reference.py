"""Print the config reference of docs/configuration.md (a markdown table per dataclass) from configs/.

    python scripts/config_reference.py

tests/test_docs.py checks that docs/configuration.md contains exactly this output, so the docs cannot drift
from the code: after changing a field, paste the new output into docs/configuration.md (its "Reference"
section).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.cli import ALIASES, field_specs, format_value, help_text, type_label  # noqa: E402
from configs.paths import REPO_ROOT  # noqa: E402
from configs.run import SECTION_TITLES, RunConfig  # noqa: E402

TABLE_HEADER = "| flag | values | default | meaning |"


def _default_text(value) -> str:
    text = format_value(value)
    # Paths into the checkout are shown relative to it, so the table is the same on every machine.
    return text.replace(str(REPO_ROOT) + "/", "") if isinstance(value, str) else text


def reference_markdown() -> str:
    defaults = RunConfig()
    lines = []
    for section, title in SECTION_TITLES.items():
        lines += [f"#### {title}", "", TABLE_HEADER, "| --- | --- | --- | --- |"]
        for spec in field_specs():
            if spec.section != section:
                continue
            flag = " / ".join(f"`{f}`" for f in [f"--{spec.name}", *ALIASES.get(spec.name, [])])
            default = _default_text(getattr(getattr(defaults, section), spec.name))
            values = type_label(spec).replace("|", " or ")
            lines.append(f"| {flag} | {values} | `{default}` | {help_text(spec)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())
