"""Simulated timeline events: column arrays, turned into the runtime's event rows in bulk."""
from __future__ import annotations

import numpy as np

from ..timeline import schema

ROLE_CODES = {name: i for i, name in enumerate(schema.ROLES)}
NONE = ROLE_CODES["none"]
ROLE_BYTES = np.array([r.encode() for r in schema.ROLES], dtype="S8")
NAME_CODES = {name: i for i, name in enumerate(schema.EVENT_NAMES)}
NAME_BYTES = np.array([n.encode() for n in schema.EVENT_NAMES], dtype="S16")


class EventBuffer:
    """Timeline events as column arrays, turned into schema.EVENT_DTYPE rows in bulk."""

    def __init__(self):
        self.parts: list[tuple] = []
        self.rows = 0

    def add(self, iteration, ranks, roles, name, start, end, critical=schema.NOT_A_SWITCH, tokens=0, nbytes=0,
            attrs=None):
        """Events of `name` on `ranks` (arrays or scalars broadcast; `attrs`: one dict or a list
        of dicts, one per rank, JSON-encoded as the runtime's recorder does)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        n = len(ranks)
        if n == 0:
            return
        if attrs is not None:
            if isinstance(attrs, list):       # per rank, mostly the same few dicts: each encoded once
                encoded: dict[str, bytes] = {}
                keys = [repr(a) for a in attrs]
                for key, a in zip(keys, attrs):
                    if key not in encoded:
                        encoded[key] = schema.encode_attrs(a)
                attrs = [encoded[key] for key in keys]
            else:
                attrs = schema.encode_attrs(attrs)
            attrs = np.broadcast_to(np.asarray(attrs, dtype=f"S{schema.ATTRS_BYTES}"), n)
        self.parts.append((iteration, ranks, roles, NAME_CODES[name], np.broadcast_to(start, n),
                           np.broadcast_to(end, n), critical, np.broadcast_to(tokens, n),
                           np.broadcast_to(nbytes, n), attrs))
        self.rows += n

    def take(self) -> np.ndarray:
        out = np.zeros(self.rows, dtype=schema.EVENT_DTYPE)
        pos = 0
        for it, ranks, roles, name, start, end, critical, tokens, nbytes, attrs in self.parts:
            sl = slice(pos, pos + len(ranks))
            out["iteration"][sl] = it
            out["rank"][sl] = ranks
            out["role"][sl] = ROLE_BYTES[roles]
            out["name"][sl] = NAME_BYTES[name]
            out["start"][sl] = start
            out["end"][sl] = end
            out["critical"][sl] = critical
            out["tokens"][sl] = tokens
            out["bytes"][sl] = nbytes
            if attrs is not None:
                out["attrs"][sl] = attrs
            pos += len(ranks)
        self.parts, self.rows = [], 0
        return out
