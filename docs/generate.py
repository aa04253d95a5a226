"""The README's table of faults tried and what happens, generated from the tests that try them.

Every such test carries `@pytest.mark.fault("the fault", "what happens")`; this script reads them
(without running anything) and prints the Markdown table that the README holds between
`<!-- faults -->` and `<!-- /faults -->`:

    python tests/fault_table.py            # print the table
    python tests/fault_table.py --write    # put it into README.md

tests/test_faults.py checks that the README's table is the one the tests say.
"""
from __future__ import annotations

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- faults -->", "<!-- /faults -->"


def faults() -> list[tuple[str, str, str]]:
    """(fault, what happens, test file::name) of every test marked with pytest.mark.fault."""
    rows = []
    folder = os.path.join(ROOT, "tests")
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "fault"
                        and len(dec.args) == 2):
                    fault, outcome = (ast.literal_eval(a) for a in dec.args)
                    rows.append((fault, outcome, f"{name}::{node.name}"))
    return rows


def table() -> str:
    lines = ["| fault tried | what happens | test |", "|---|---|---|"]
    lines += [f"| {f} | {o} | `{t}` |" for f, o, t in faults()]
    return "\n".join(lines)


SECTION = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.S)


def readme_table(readme: str) -> str:
    m = SECTION.search(readme)
    return m.group(1).strip() if m else ""


def main(argv: list[str]) -> int:
    if "--write" in argv:
        path = os.path.join(ROOT, "README.md")
        text = open(path).read()
        if BEGIN not in text:
            print(f"README.md has no {BEGIN} ... {END} section", file=sys.stderr)
            return 1
        text = SECTION.sub(lambda m: f"{BEGIN}\n{table()}\n{END}", text)
        open(path, "w").write(text)
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
