"""The reference pages generated from the code, so that they cannot go stale:

    docs/reference/config.md     every config field (the dataclasses of dynaresize/config.py, with the
                                 comment beside each field) and every preset of dynaresize/conf/
    docs/reference/commands.md   the --help of every command-line tool
    docs/reference/faults.md     the faults tried, from the tests marked @pytest.mark.fault
    docs/reference/metrics.md    the metric definitions, from the docstring of the module that computes them

    python docs/generate.py --write     # write the pages
    python docs/generate.py --check     # exit 1 naming each page that is out of date

The docs build (docs/hooks/generated.py) and tests/test_docs.py run the check.
"""
from __future__ import annotations

import ast
import dataclasses
import io
import os
import re
import subprocess
import sys
import tokenize
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_SOURCE = os.path.join(ROOT, "dynaresize", "config.py")
CONF_DIR = os.path.join(ROOT, "dynaresize", "conf")

# The command-line tools with an argparse --help (dynaresize and dynaresize-sim are Hydra apps:
# their options are the config fields).
COMMANDS = [
    ("dynaresize-analyze", ["-m", "dynaresize.analysis", "--help"]),
    ("dynaresize-analyze compare", ["-m", "dynaresize.analysis", "compare", "--help"]),
    ("dynaresize-analyze plan", ["-m", "dynaresize.analysis", "plan", "--help"]),
    ("dynaresize-sim suite", ["-m", "dynaresize.sim", "suite", "--help"]),
    ("dynaresize-sim inside", ["-m", "dynaresize.sim", "inside", "--help"]),
    ("dynaresize-bench", ["-m", "dynaresize.launch.bench", "--help"]),
    ("dynaresize-bench memory", ["-m", "dynaresize.launch.bench", "memory", "--help"]),
    ("dynaresize-calibrate", ["-m", "dynaresize.plan.calibrate", "--help"]),
    ("python -m dynaresize.data.tiny_model", ["-m", "dynaresize.data.tiny_model", "--help"]),
]


def field_comments(path: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the comment on the field's line, or the comment lines just above it."""
    comments: dict[tuple[str, str], str] = {}
    cls, above = None, []
    with open(path) as f:
        lines = f.read().splitlines()
    tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline))
    by_line: dict[int, str] = {t.start[0]: t.string.lstrip("# ").rstrip() for t in tokens
                               if t.type == tokenize.COMMENT}
    for n, line in enumerate(lines, start=1):
        m = re.match(r"class (\w+)", line)
        if m:
            cls, above = m.group(1), []
            continue
        m = re.match(r"    (\w+): [^=]+(=|$)", line)
        if cls and m and not line.strip().startswith("#"):
            # the comment on the field's own line; else the comment lines just above it
            comments[(cls, m.group(1))] = by_line.get(n) or " ".join(above).strip()
            above = []
        elif line.strip().startswith("#") and cls:
            text = line.strip().lstrip("# ").rstrip()
            last = list(comments)[-1] if comments else None
            if line.startswith(" " * 12) and last and last[0] == cls and not above:   # a field's comment, continued
                comments[last] += " " + text
            else:
                above.append(text)
        elif not line.strip():
            above = []
    return comments


def type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in args) + (" or null" if len(args) < len(typing.get_args(tp)) else "")
    if isinstance(tp, type) and typing.get_origin(tp) is None:
        return tp.__name__
    return str(tp).replace("typing.", "")


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:       # type: ignore[misc]
        value = f.default_factory()                          # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return ""
    else:
        return ""
    return "`null`" if value is None else f"`{value!r}`".replace("|", "\\|")


def preset_lines(group: str) -> list[str]:
    directory = os.path.join(CONF_DIR, group)
    if not os.path.isdir(directory):
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".yaml"):
            continue
        with open(os.path.join(directory, name)) as f:
            head = []
            for line in f:
                if not line.startswith("#"):
                    break
                if not line.startswith("# @package"):
                    head.append(line.lstrip("# ").rstrip())
        first = " ".join(head).split(". ")[0].rstrip(".")
        out.append(f"| `{name[:-5]}` | {first} |")
    return out


def config_page() -> str:
    sys.path.insert(0, ROOT)
    from dynaresize import config

    comments = field_comments(CONFIG_SOURCE)
    hints = typing.get_type_hints(config.JobConfig)
    lines = ["# Configuration reference", "",
             "Generated from the typed schema (`dynaresize/config.py`) and the presets of "
             "`dynaresize/conf/` when this site is built. Set any field on the command line "
             "(`dynaresize trainer.lr=3e-4`), choose a preset of a group (`dynaresize policy=static`), "
             "or add a group that the default config does not select (`+hardware=h100`). "
             "`dynaresize --cfg job` prints the composed config of a command line.", ""]
    for f in dataclasses.fields(config.JobConfig):
        tp = hints[f.name]
        lines += [f"## `{f.name}`", ""]
        doc = (tp.__doc__ or "") if dataclasses.is_dataclass(tp) else ""
        if doc and not doc.startswith(tp.__name__ + "("):
            lines += [" ".join(doc.split()), ""]
        presets = preset_lines(f.name)
        if presets:
            lines += ["Presets (`dynaresize/conf/%s/`):" % f.name, "", "| preset | what |", "|---|---|",
                      *presets, ""]
        if dataclasses.is_dataclass(tp):
            sub = typing.get_type_hints(tp)
            lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
            for g in dataclasses.fields(tp):
                text = comments.get((tp.__name__, g.name), "").replace("|", "\\|")
                lines.append(f"| `{f.name}.{g.name}` | {type_name(sub[g.name])} | {default_text(g)} | {text} |")
        else:
            text = comments.get(("JobConfig", f.name), "").replace("|", "\\|")
            lines += [f"Type {type_name(tp)}, default {default_text(f) or '(see below)'}. {text}"]
        lines.append("")
    return "\n".join(lines) + "\n"


def commands_page() -> str:
    lines = ["# Command reference", "",
             "`dynaresize` and `dynaresize-sim` are Hydra applications: their options are the config "
             "fields ([configuration reference](config.md)), plus Hydra's own (`--help`, `--cfg job`, "
             "`-m` for sweeps). The other commands' `--help`, generated when this site is built:", ""]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="100")
    for title, args in COMMANDS:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{title} --help failed ({proc.returncode}): {proc.stderr[-2000:]}")
        lines += [f"## `{title}`", "", "```text", proc.stdout.rstrip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


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


def faults_page() -> str:
    lines = ["# Faults tried", "",
             "A fault campaign: each row is a test that provokes the fault with real processes, files and "
             "signals, and checks what happens. Generated from the tests marked "
             "`@pytest.mark.fault(\"the fault\", \"what happens\")` (`python docs/generate.py --write`).", "",
             "| fault tried | what happens | test |", "|---|---|---|"]
    lines += [f"| {f} | {o} | `{t}` |" for f, o, t in faults()]
    return "\n".join(lines) + "\n"


def metrics_page() -> str:
    """The definitions section of dynaresize/analysis/metrics.py's docstring as a definition list."""
    tree = ast.parse(open(os.path.join(ROOT, "dynaresize", "analysis", "metrics.py")).read())
    doc = ast.get_docstring(tree)
    body = doc.split("Definitions\n-----------\n", 1)[1].split("\n\nOver ", 1)[0]
    lines = ["# Metric definitions", "",
             "The only definitions used by `dynaresize-analyze`, the report, the loggers and the suite, "
             "generated from the docstring of `dynaresize/analysis/metrics.py`, the module that computes "
             "them.", ""]
    for block in body.strip().split("\n\n"):
        term, _, text = block.partition("\n")
        text = " ".join(text.split()).replace("``", "`")
        lines += [f"**{term.strip()}.** {text}", ""]
    return "\n".join(lines).rstrip() + "\n"


PAGES = {"reference/config.md": config_page, "reference/commands.md": commands_page,
         "reference/faults.md": faults_page, "reference/metrics.md": metrics_page}


def stale() -> list[str]:
    """The generated pages whose file differs from what the code says now."""
    out = []
    for page, make in PAGES.items():
        path = os.path.join(ROOT, "docs", page)
        current = open(path).read() if os.path.exists(path) else None
        if current != make():
            out.append(f"docs/{page}")
    return out


def main(argv: list[str]) -> int:
    if "--write" in argv:
        for page, make in PAGES.items():
            path = os.path.join(ROOT, "docs", page)
            text = make()                   # before opening the page: a failure leaves it as it was
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote docs/{page}")
        return 0
    if "--check" in argv:
        out = stale()
        for page in out:
            print(f"{page} is out of date: run python docs/generate.py --write", file=sys.stderr)
        return 1 if out else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
