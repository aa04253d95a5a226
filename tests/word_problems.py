"""Deterministic arithmetic word problems in GSM8K's format, as a small data set for tests."""
from __future__ import annotations

import json
import random

NAMES = [("Tom", "he"), ("Maria", "she"), ("Ali", "he"), ("Priya", "she"), ("Chen", "he"),
         ("Sofia", "she"), ("Kwame", "he"), ("Lena", "she")]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells"]


def _problem(rng: random.Random) -> tuple[str, str]:
    """One (question, GSM8K-style solution ending in "#### N")."""
    name, he = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    kind = rng.choice(["add", "sub", "mul", "div", "two_step"])
    if kind == "add":
        q = f"{name} has {a} {item} and buys {b} more. How many {item} does {he} have now?"
        r = a + b
        steps = f"{name} has {a} + {b} = <<{a}+{b}={r}>>{r} {item}."
    elif kind == "sub":
        a, b = max(a, b), min(a, b)
        q = f"{name} had {a} {item} and gave {b} to a friend. How many {item} are left?"
        r = a - b
        steps = f"{name} has {a} - {b} = <<{a}-{b}={r}>>{r} {item} left."
    elif kind == "mul":
        a, b = a % 12 + 2, b % 20 + 2
        q = f"There are {a} boxes with {b} {item} in each box. How many {item} are there in total?"
        r = a * b
        steps = f"There are {a} * {b} = <<{a}*{b}={r}>>{r} {item}."
    elif kind == "div":
        per, friends = a % 15 + 1, b % 9 + 2
        total = per * friends
        q = f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?"
        r = per
        steps = f"Each friend gets {total} / {friends} = <<{total}/{friends}={r}>>{r} {item}."
    else:
        c = rng.randint(1, min(a, b))
        q = (f"A shop sold {a} {item} on Monday and {b} on Tuesday. {c} were returned. "
             f"How many {item} did the shop sell in the end?")
        r = a + b - c
        steps = (f"The shop sold {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n"
                 f"After returns it sold {a + b} - {c} = <<{a + b}-{c}={r}>>{r} {item}.")
    return q, f"{steps}\n#### {r}"


def word_problems(n: int = 200, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q, a = _problem(rng)
        rows.append({"question": q, "answer": a, "id": f"wp{seed}-{i:05d}"})
    return rows


def write_word_problems(path, n: int = 200, seed: int = 0, fmt: str = "jsonl"):
    """Write `n` problems (fields question, answer, id) to `path` as jsonl or parquet."""
    rows = word_problems(n, seed)
    if fmt == "jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    elif fmt == "parquet":
        import pandas as pd
        pd.DataFrame(rows).to_parquet(path, index=False)
    else:
        raise ValueError(f"fmt is {fmt!r}; use 'jsonl' or 'parquet'")
    return path
