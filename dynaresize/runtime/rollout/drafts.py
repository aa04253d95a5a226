"""Draft tokens from a prompt group's sibling responses (tail speculation: rollout.speculation).

GRPO samples several responses to one prompt, and they share phrases, formulas and whole lines. A
row's draft is what followed its last tokens where they occur in a sibling's response: suffix
matching, as vLLM's `ngram` method matches the prompt, over the group instead. It costs no model and
pays where speculation pays, at the tail, when few sequences are left and a step that verifies
several tokens costs about what a step that decodes one does (Seer, arXiv 2511.14617, drafts from
the group the same way). No torch here.
"""
from __future__ import annotations

# The longest suffix of a row matched in its siblings: longer matches predict better, and a match
# of 4 tokens already names one place in a response of thousands.
MAX_MATCH = 4


def sibling_draft(rows: list[list[int]], row: int, k: int, max_match: int = MAX_MATCH) -> list[int]:
    """Up to `k` draft tokens for `rows[row]` (every row: the tokens a sample has generated so far):
    the longest suffix of the row, of `max_match` tokens at most, that occurs in another row with a
    token after it; at its last occurrence in each sibling, the tokens that follow; the longest of
    those continuations (ties: the lower row). [] if no suffix of the row occurs in a sibling."""
    own = rows[row]
    if k <= 0 or not own:
        return []
    for n in range(min(max_match, len(own)), 0, -1):
        suffix = own[-n:]
        best: list[int] = []
        for other, tokens in enumerate(rows):
            if other == row:
                continue
            at = _last_occurrence(tokens, suffix)
            follows = [] if at is None else tokens[at + n:at + n + k]
            if len(follows) > len(best):
                best = follows
        if best:
            return best
    return []


def _last_occurrence(tokens: list[int], pattern: list[int]) -> int | None:
    """The start of the last occurrence of `pattern` in `tokens` followed by at least one token."""
    n = len(pattern)
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start] == pattern[0] and tokens[start:start + n] == pattern:
            return start
    return None
