"""MkDocs hook: the build fails (with --strict) when a generated reference page is out of date."""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("mkdocs.hooks.generated")


def on_pre_build(config):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import generate
    for page in generate.stale():
        log.warning(f"{page} is out of date: run python docs/generate.py --write")
