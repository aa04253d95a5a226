"""Your prompts: rows of JSONL or Parquet files, tokenized with the model's own tokenizer.

`workload.task=dataset` (preset `workload=dataset`) takes each batch's prompts from `data.*`:
the rows of `data.train_files`, walked epoch by epoch, each epoch in its own permutation keyed by
(run.seed, epoch). Batch b starts where batch b-1 ended, so a batch is a pure function of (seed,
batch index, prompt index) as with the built-in tasks: where and by how many ranks it is generated
never changes it, and a resumed run continues the sequence. A later round of dynamic sampling
(trainer.filter_groups) takes the same positions of the permutations of its own seed.

A prompt is the row's `data.prompt_key` text, wrapped as one user message by the tokenizer's chat
template (`data.apply_chat_template`); its reference answer is `data.answer_key`; the row's other
fields go to the reward as `extra`. Responses end at the model's end-of-sequence token or at the
batch's cap (`workload.length_max`): their lengths are whatever the policy produces.

`check_dataset` reads and tokenizes every prompt once in the launching process, so a missing
field, a prompt too long or a model with too few positions is reported before any rank starts.
"""
from __future__ import annotations

import json
import math
import os
from functools import lru_cache

import numpy as np

from ..config import ConfigError, DataConfig, JobConfig
from .shapes import keyed_rng, max_response_cap, response_cap, round_seed
from .workload import DigitTask, Prompt, Task

_ORDER_STREAM = 0x64617461        # "data": the permutation of each epoch


def read_file(path: str) -> list[dict]:
    """The rows of one file: JSONL (one object per line), a JSON list, or Parquet; a ValueError
    naming the file and what is wrong."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    if path.endswith(".parquet"):
        import pandas as pd
        try:
            return pd.read_parquet(path).to_dict("records")
        except ImportError as e:
            raise ValueError(f"{path}: reading Parquet needs pyarrow ({e}); pip install "
                             f"'dynaresize[parquet]', or convert the file to JSONL") from None
    if not path.endswith((".jsonl", ".json")):
        raise ValueError(f"{path}: use a .jsonl (one JSON object per line), .json (a list) or .parquet file")
    with open(path) as f:
        if path.endswith(".json"):
            rows = json.load(f)
            if not isinstance(rows, list):
                raise ValueError(f"{path} holds a JSON {type(rows).__name__}, not a list of rows")
            return rows
        rows = []
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path} line {n} is not JSON ({e})") from None
        return rows


def read_rows(files: list[str], field: str = "data.train_files") -> list[dict]:
    """Every row of the files `files` (config field `field`), in order; a ConfigError naming the
    file's entry."""
    rows: list[dict] = []
    for i, path in enumerate(files):
        try:
            rows += read_file(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"invalid configuration:\n  {field}[{i}]: {e}. Fix: give JSONL "
                              f"(one object per line), a JSON list or Parquet.") from None
    if not rows:
        raise ConfigError(f"invalid configuration:\n  {field}: the files hold no rows. "
                          "Fix: give files with at least one prompt.")
    return rows


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    from .model import quiet_transformers
    quiet_transformers()
    return AutoTokenizer.from_pretrained(model_dir)


class PromptEncoder:
    """Prompt text -> token ids the way `data.*` says (chat template, length limit)."""

    def __init__(self, cfg: DataConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer

    def full(self, text: str) -> list[int]:
        """All the prompt's tokens, before any length limit."""
        tok = self.tokenizer
        if self.cfg.apply_chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(text)["input_ids"])

    def __call__(self, text: str) -> list[int]:
        ids, limit = self.full(text), self.cfg.max_prompt_length
        if limit is None or len(ids) <= limit:
            return ids
        if self.cfg.truncation == "left":        # keep the end: the question and the generation prompt
            return ids[-limit:]
        if self.cfg.truncation == "right":
            return ids[:limit]
        raise ValueError(f"a prompt of {len(ids)} tokens is longer than data.max_prompt_length={limit}")


class DatasetTask:
    """The prompts of a batch drawn from the dataset (see the module docstring)."""

    def __init__(self, cfg: JobConfig, model_dir: str):
        self.cfg, self.data, self.workload = cfg, cfg.data, cfg.workload
        self.tokenizer = load_tokenizer(model_dir)
        self.encode = PromptEncoder(cfg.data, self.tokenizer)
        self.rows = usable_rows(read_rows(cfg.data.train_files), cfg.data)
        self.val_rows = usable_rows(read_rows(cfg.data.val_files, "data.val_files"), cfg.data) if cfg.data.val_files else []

    @lru_cache(maxsize=4)
    def _epoch_order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        n = len(self.rows)
        return keyed_rng(seed, epoch, _ORDER_STREAM).permutation(n) if shuffle else np.arange(n)

    def row_indices(self, seed: int, batch: int, num_prompts: int, round: int = 0) -> list[int]:
        """The dataset rows of batch `batch`: the next ones of the epoch-by-epoch sequence (a
        later round's: of a permutation of its own, also with data.shuffle=false)."""
        start, n = batch * num_prompts, len(self.rows)
        shuffle, seed = self.data.shuffle or round > 0, round_seed(seed, round)
        return [int(self._epoch_order(seed, pos // n, shuffle)[pos % n]) for pos in range(start, start + num_prompts)]

    def batch(self, seed: int, batch: int, num_prompts: int, samples_per_prompt: int, round: int = 0) -> list[Prompt]:
        cap = response_cap(self.workload, batch)
        return [self._prompt(i, self.rows, row_index, cap, samples_per_prompt)
                for i, row_index in enumerate(self.row_indices(seed, batch, num_prompts, round))]

    def held_out(self, seed: int, num_prompts: int, samples_per_prompt: int, cap: int) -> list[Prompt]:
        """The evaluation's prompts: the first `num_prompts` rows of data.val_files (0: all)."""
        count = len(self.val_rows) if num_prompts <= 0 else min(num_prompts, len(self.val_rows))
        return [self._prompt(i, self.val_rows, i, cap, samples_per_prompt) for i in range(count)]

    def _prompt(self, index: int, rows: list[dict], row_index: int, cap: int, samples_per_prompt: int) -> Prompt:
        p, a = self.data.prompt_key, self.data.answer_key
        row = rows[row_index]
        extra = {k: v for k, v in row.items() if k not in (p, a)}
        extra["row"] = row_index
        return Prompt(index=index, tokens=tuple(self.encode(str(row[p]))), answer=str(row[a]),
                      response_lens=(cap,) * samples_per_prompt, text=str(row[p]), extra=extra)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def check_dataset(cfg: JobConfig) -> str:
    """Read and tokenize every prompt once, before any rank starts; raise ConfigError naming the
    field, the row and the fix. Returns a one-line summary for the launcher to print."""
    d = cfg.data
    tokenizer = load_tokenizer(cfg.model.path)
    if d.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"invalid configuration:\n  data.apply_chat_template: the tokenizer in "
                          f"{cfg.model.path} has no chat template. Fix: data.apply_chat_template=false "
                          f"(the prompt text is tokenized as it is), or use a model with one.")
    encode = PromptEncoder(d, tokenizer)
    rows, lengths, skipped = _checked_rows(d, encode, d.train_files, "data.train_files")
    trained = len(rows)
    if d.val_files:
        val_rows, val_lengths, val_skipped = _checked_rows(d, encode, d.val_files, "data.val_files")
        rows, lengths, skipped = rows + val_rows, np.concatenate([lengths, val_lengths]), skipped + val_skipped
    longest_row = int(lengths.argmax())
    if d.max_prompt_length is not None and d.truncation == "error" and lengths.max() > d.max_prompt_length:
        over = int((lengths > d.max_prompt_length).sum())
        raise ConfigError(f"invalid configuration:\n  data.max_prompt_length: {over} prompt(s) are longer than "
                          f"{d.max_prompt_length} tokens (row {longest_row} has {lengths.max()}). Fix: raise "
                          f"data.max_prompt_length, or truncate with data.truncation=left (keep the end) or right.")
    longest_prompt = int(lengths.max()) if d.max_prompt_length is None else min(int(lengths.max()), d.max_prompt_length)
    positions = _max_positions(cfg.model.path)
    longest = longest_prompt + max_response_cap(cfg.workload)
    if positions is not None and longest > positions:
        raise ConfigError(f"invalid configuration:\n  workload.length_max: the longest prompt ({longest_prompt} "
                          f"tokens, row {longest_row}) plus the response cap ({max_response_cap(cfg.workload)}) is "
                          f"{longest} tokens, more than the model's max_position_embeddings ({positions}). Fix: "
                          f"lower workload.length_max or data.max_prompt_length, or use a model with more positions.")
    held_out = f" (and {len(rows) - trained} held out)" if d.val_files else ""
    skip = f", {skipped} bad rows skipped (data.skip_bad_rows)" if skipped else ""
    return (f"dataset: {trained} prompts{held_out}{skip} from {len(d.train_files) + len(d.val_files)} file(s), "
            f"prompt tokens median {int(np.median(lengths))} / max {int(lengths.max())}, responses up to "
            f"{max_response_cap(cfg.workload)}")


def bad_value(row: dict, d: DataConfig) -> str | None:
    """What is wrong with a row's prompt or answer (the field and why), or None: a prompt is
    non-empty text; an answer is text or a finite number."""
    prompt, answer = row.get(d.prompt_key), row.get(d.answer_key)
    if not isinstance(prompt, str):
        return f"{d.prompt_key!r} is {prompt!r}, not text"
    if not prompt.strip():
        return f"{d.prompt_key!r} is empty"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or (
            isinstance(answer, float) and not math.isfinite(answer)):
        return f"{d.answer_key!r} is {answer!r}, not text or a finite number"
    return None


def usable_rows(rows: list[dict], d: DataConfig) -> list[dict]:
    """`rows` without those `bad_value` refuses (data.skip_bad_rows: check_dataset has said how
    many); every rank and the launcher drop the same ones."""
    return [row for row in rows if bad_value(row, d) is None] if d.skip_bad_rows else rows


def _checked_rows(d: DataConfig, encode: PromptEncoder, files: list[str], field: str):
    """The usable rows of `files` (config field `field`), their prompts' token counts and how many
    bad rows data.skip_bad_rows dropped, or a ConfigError naming the file, the row, the field and
    the fix."""
    rows, where = [], []
    for i, path in enumerate(files):
        part = read_rows([path], f"{field}[{i}]")
        rows += part
        where += [(path, n) for n in range(len(part))]
    problems = []
    for key, name in ((d.prompt_key, "data.prompt_key"), (d.answer_key, "data.answer_key")):
        missing = next((i for i, row in enumerate(rows) if not isinstance(row, dict) or key not in row), None)
        if missing is not None:
            fields = sorted(rows[missing]) if isinstance(rows[missing], dict) else type(rows[missing]).__name__
            problems.append(f"  {name}: row {missing} of {field} has no field {key!r} (its fields: {fields}). "
                            f"Fix: set {name} to the field that holds it.")
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(problems))
    bad = [(where[i], why) for i, row in enumerate(rows) if (why := bad_value(row, d)) is not None]
    if bad and not d.skip_bad_rows:
        lines = [f"  {field}: {path} row {n}: {why}" for (path, n), why in bad[:5]]
        more = f"\n  ... and {len(bad) - 5} more rows" if len(bad) > 5 else ""
        raise ConfigError("invalid configuration:\n" + "\n".join(lines) + more + "\n  Fix: correct those rows, "
                          "or skip them with data.skip_bad_rows=true (their number is printed).")
    rows = usable_rows(rows, d)
    if not rows:
        raise ConfigError(f"invalid configuration:\n  {field}: every row is bad ({len(bad)} rows). Fix: correct them.")
    return rows, np.array([len(encode.full(str(row[d.prompt_key]))) for row in rows]), len(bad)


def _max_positions(model_dir: str) -> int | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None
    value = hf.get("max_position_embeddings", hf.get("n_positions"))
    return value if isinstance(value, int) else None


def make_task(cfg: JobConfig, model_dir: str) -> Task:
    """The source of prompts `workload.task` names: your dataset, or a built-in digit task."""
    if cfg.workload.task == "dataset":
        return DatasetTask(cfg, model_dir)
    return DigitTask(cfg.workload)
