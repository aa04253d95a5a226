"""Reward functions: the part of a GRPO job that users write.

A reward is a plain function, importable on every rank, with this interface:

    def my_reward(prompt: str, response: str, answer: str, extra: dict) -> float: ...

- `prompt`: the prompt text;
- `response`: the decoded response, special tokens removed;
- `answer`: the dataset row's reference answer text;
- `extra`: the row's other fields, plus `finished` (bool): True when the response ended at the
  end-of-sequence token, False when it was cut at the length cap.

The config names it by dotted path (`reward._target_: mypkg.rewards.my_reward`); `reward.kwargs` are
passed as keyword arguments (`load_reward` binds them with functools.partial). A reward that raises
is handled by the job as `reward.on_error` says (fail: end the job naming the sample; zero: score 0
and warn), so a reward need not catch its own errors.

Two rewards come built in: `digit_match` (the synthetic digit tasks) and `gsm8k` (final numeric
answer, GSM8K style).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import signal
import threading
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Callable, Optional

RewardFn = Callable[[str, str, str, dict], float]


def digit_match(prompt: str, response: str, answer: str, extra: dict) -> float:
    """Fraction of the answer's positions the response matches, where stopping right after the
    answer (ending at end-of-sequence with nothing more) counts as one more position."""
    hits = sum(1 for want, got in zip(answer, response) if want == got)
    stopped = bool(extra.get("finished")) and len(response) == len(answer)
    return (hits + int(stopped)) / (len(answer) + 1)


# A number as written in solutions: sign (not after a word or ")", so "5-3" is not "-3"), an
# optional "$", comma-grouped or plain digits, decimals, an optional "/denominator" and "%".
_NUMBER = re.compile(
    r"(?:(?<![\w)])[-+])?\$?"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*\d+)?%?"
)
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")


def _boxed_contents(text: str) -> Optional[str]:
    """The content of the last complete \\boxed{...} (braces matched, so nested \\frac{1}{2}
    survives); an unclosed box, as in a truncated response, does not count."""
    found = None
    for m in _BOXED.finditer(text):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i >= len(text):
            continue
        if text[i] != "{":  # "\boxed 5": up to the next space or "$"
            token = re.match(r"[^\s$]+", text[i:])
            found = token.group(0) if token else found
            continue
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                found = text[i + 1:j].strip()
                break
    return found


def extract_final_answer(text: str) -> Optional[str]:
    """The final answer in a solution, as written: the last \\boxed{...}, else what follows the
    last "####", else the last number in the text; None when there is none."""
    boxed = _boxed_contents(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        first_line = tail.splitlines()[0].strip() if tail else ""
        number = _NUMBER.search(first_line)
        if number and "\\" not in first_line:  # LaTeX such as \frac{1}{2} is kept whole
            return number.group(0)
        if first_line:
            return first_line
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _clean(text: str) -> str:
    """Drop what does not change the value: whitespace, "$", thousands commas, "%", LaTeX spacing
    and \\left/\\right, a leading "+", a trailing "."."""
    s = text.strip()
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "\\%", "$", "%", " "):
        s = s.replace(junk, "")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    return s.rstrip(".").lstrip("+")


def _as_number(text: str) -> Optional[Fraction]:
    """The exact value of a cleaned answer ("72.00", "-3.5", "3/4", "\\frac{3}{4}"), else None."""
    s = _clean(text)
    frac = re.fullmatch(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if frac:
        s = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    try:
        return Fraction(s)  # exact for decimals, unlike float ==
    except (ValueError, ZeroDivisionError):
        pass
    # "18 dollars", "\text{18 apples}": a text with exactly one number means that number.
    numbers = _NUMBER.findall(text)
    if len(numbers) == 1 and numbers[0].strip() != text.strip():
        return _as_number(numbers[0])
    return None


def answers_equal(a: str, b: str) -> bool:
    """Same value (exact comparison) when both are numbers, else same text after cleaning."""
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return x == y
    return _clean(a) == _clean(b)


def _reference(answer: str) -> str:
    """The reference's final answer: a bare answer as is, a full solution's "#### N" or box."""
    if "####" in answer or _BOXED.search(answer):
        return extract_final_answer(answer) or answer.strip()
    return answer.strip()


def gsm8k(prompt: str, response: str, answer: str, extra: dict,
          format_score: float = 0.0) -> float:
    """1.0 when the response's final answer equals the reference's, `format_score` when an answer
    was found but is wrong, 0.0 when the response gives none."""
    got = extract_final_answer(response)
    if got is None:
        return 0.0
    return 1.0 if answers_equal(got, _reference(answer)) else format_score


def load_reward(target: str, kwargs: Optional[Mapping[str, Any]] = None) -> RewardFn:
    """The reward function at dotted path `target`, with `kwargs` bound; a ValueError that names
    the field and the fix when it cannot be loaded."""
    from hydra.utils import get_method

    fix = ("Fix: set it to the dotted path of a function importable on every rank, e.g. "
           "dynaresize.data.rewards.gsm8k (put your module on PYTHONPATH)")
    if not isinstance(target, str) or "." not in target:
        raise ValueError(f"reward._target_: {target!r} is not a dotted path. {fix}")
    hydra_log = logging.getLogger("hydra.utils")   # it logs the failure too; ours names the field
    level, hydra_log.level = hydra_log.level, logging.CRITICAL
    try:
        fn = get_method(target)
    except Exception as e:  # ImportError, AttributeError, "non-callable": all the same fix
        cause = e.__cause__ or e
        reason = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        raise ValueError(f"reward._target_: {target!r} cannot be loaded ({reason}). {fix}") from e
    finally:
        hydra_log.level = level
    kwargs = dict(kwargs or {})
    if not kwargs:
        return fn
    # A misspelt keyword would otherwise fail on every call, far from the config.
    try:
        inspect.signature(fn).bind_partial("", "", "", {}, **kwargs)
    except TypeError as e:
        raise ValueError(f"reward.kwargs: {sorted(kwargs)} do not fit {target} ({e}). "
                         f"Fix: use only keyword arguments that {target} takes") from e
    except ValueError:
        pass  # no signature to check (some builtins)
    return functools.partial(fn, **kwargs)


class RewardError(RuntimeError):
    """A reward function failed on a sample (reward.on_error=fail)."""


class RewardTimeout(Exception):
    """A reward call that did not return within reward.timeout_s."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise RewardTimeout in the block after `seconds` (SIGALRM: the main thread only, and Python
    code only; a call stuck inside C code is left to the stall watchdog). 0: no limit."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RewardTimeout(f"did not return within reward.timeout_s={seconds:g} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Scorer:
    """The configured reward applied to one generated sample, with `reward.on_error`'s policy.

    The rank that generated a sample scores it (the reward is part of rollout, as in verl)."""

    def __init__(self, cfg, decode: Callable[[list[int]], str], eos_ids: list[int]):
        self.target, self.on_error, self.timeout_s = cfg._target_, cfg.on_error, cfg.timeout_s
        self.fn = load_reward(cfg._target_, cfg.kwargs)
        self.decode, self.eos_ids = decode, set(eos_ids)
        self.failures = 0           # samples scored 0 because the reward failed (on_error=zero)

    def finished(self, tokens: list[int]) -> bool:
        """Whether a response ended at the model's end-of-sequence token (not cut at the cap)."""
        return bool(tokens) and tokens[-1] in self.eos_ids

    def __call__(self, prompt, tokens: list[int], batch: int, sample: int) -> float:
        response = self.decode(tokens)
        extra = {**prompt.extra, "finished": self.finished(tokens)}
        try:
            with time_limit(self.timeout_s):
                value = float(self.fn(prompt.text, response, prompt.answer, extra))
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"returned {value}, not a finite number")
        except Exception as e:   # whatever the user's function raises: reported with the sample
            where = (f"the reward {self.target} failed on batch {batch}, prompt {prompt.index}, sample {sample} "
                     f"({type(e).__name__}: {e}); prompt {prompt.text[:120]!r}, response {response[:120]!r}")
            if self.on_error == "fail":
                raise RewardError(f"{where}. Fix: correct the reward function, or score such samples 0 "
                                  f"with reward.on_error=zero") from e
            if self.failures < 3:
                print(f"[dynaresize] warning: {where}; scored 0 (reward.on_error=zero)", flush=True)
            self.failures += 1
            return 0.0
        return value

    def take_failures(self) -> int:
        """Failures since the last call (recorded on the rollout event)."""
        n, self.failures = self.failures, 0
        return n
