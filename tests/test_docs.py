"""The README and the docs site: the README is a short user guide whose links resolve, and the
reference pages generated from the code are current (the docs build checks the same)."""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))

import generate  # noqa: E402

LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_a_short_guide_that_opens_with_the_two_commands():
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the user guide holds at most 300"
    fence = lines.index("```bash")
    commands = lines[fence + 1:lines.index("```", fence + 1)]
    assert commands[0].startswith("python3 -m venv .venv") and commands[0].endswith(".venv/bin/dynaresize")
    assert commands[1:] == ["bash tests/run.sh"]


def test_every_readme_and_docs_link_resolves():
    """Relative links of the README and of every docs page point at files that exist (and the
    README points into docs/ for everything beyond its first screen)."""
    pages = [os.path.join(ROOT, "README.md")]
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        pages += [os.path.join(folder, f) for f in files if f.endswith(".md")]
    broken = []
    for page in pages:
        for target in LINK.findall(open(page).read()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)} -> {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_generated_reference_pages_are_current():
    assert not generate.stale(), f"out of date: {generate.stale()}; run python docs/generate.py --write"


def test_fault_table_lists_every_fault_test():
    rows = generate.faults()
    assert len(rows) >= 20 and all(t.split("::")[0].startswith("test_") for _, _, t in rows)
    page = open(os.path.join(ROOT, "docs", "reference", "faults.md")).read()
    assert all(f"`{t}`" in page for _, _, t in rows)


def test_config_reference_covers_every_field():
    """Every field of every config section has a row, and every row a meaning."""
    import dataclasses
    import typing

    from dynaresize import config
    page = generate.config_page()
    for f in dataclasses.fields(config.JobConfig):
        tp = typing.get_type_hints(config.JobConfig)[f.name]
        if dataclasses.is_dataclass(tp):
            for g in dataclasses.fields(tp):
                row = next((line for line in page.splitlines() if line.startswith(f"| `{f.name}.{g.name}` |")), None)
                assert row is not None, f"{f.name}.{g.name} missing from the configuration reference"
                assert not row.rstrip().endswith("|  |"), f"{f.name}.{g.name} has no comment in dynaresize/config.py"
