"""Results pages: the Markdown a measuring command writes into the docs (`--page PATH`).

Every results page starts with the command that measured it, the date, and the version that ran,
so a page says where its figures come from; running the command again replaces the page.
"""
from __future__ import annotations

import datetime
import os
import shlex
import subprocess


def provenance(command: list[str]) -> str:
    """`Written by `CMD` on DATE (dynaresize VERSION, commit C).` for the command `command`."""
    from .. import __version__
    commit = ""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            commit = f", commit {out.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return (f"Written by `{shlex.join(command)}` on {datetime.date.today().isoformat()} "
            f"(dynaresize {__version__}{commit}).")


def write_page(path: str, title: str, command: list[str], body: str) -> str:
    """Write the results page `path`: its title, where its figures come from, then `body`."""
    text = f"# {title}\n\n{provenance(command)}\n\n{body.strip()}\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path
