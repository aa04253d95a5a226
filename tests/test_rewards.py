"""dynaresize.data.rewards: the built-in rewards, final-answer extraction, and loading a reward by path."""
from __future__ import annotations

import functools

import pytest

from dynaresize.data.rewards import answers_equal, digit_match, extract_final_answer, gsm8k, load_reward
from word_problems import word_problems

DONE, CUT = {"finished": True}, {"finished": False}


@pytest.mark.parametrize("response, finished, want", [
    ("4321", True, 5 / 5),    # every position, and stopped right after
    ("4321", False, 4 / 5),   # cut at the length cap: no stop bonus
    ("4300", True, 3 / 5),    # two positions, and stopped
    ("43210", True, 4 / 5),   # too long: positions count, stopping late does not
    ("43", True, 2 / 5),      # too short
    ("", True, 0.0),
    ("1234", True, 1 / 5),    # position-wise, not set-wise
])
def test_digit_match(response, finished, want):
    assert digit_match("reverse 1234", response, "4321", {"finished": finished}) == pytest.approx(want)


@pytest.mark.parametrize("text, want", [
    ("The answer is \\boxed{1,234}.", "1,234"),
    ("so the total is\n#### 72", "72"),
    ("#### 72 apples", "72"),
    ("It costs $1,000.", "$1,000"),
    ("The temperature drops to -3", "-3"),
    ("so 3/4 of them", "3/4"),
    ("First 12, then 15, finally 1,234, done.", "1,234"),
    ("She has 5-3 = 2 left", "2"),                      # a hyphen after a digit is not a sign
    ("Tom has 17 + 25 = <<17+25=42>>42 apples.", "42"),
    ("\\boxed{7} and then I checked 8 times", "7"),    # the box wins over a later number
    ("\\boxed{1} no wait \\boxed{2}, not 3", "2"),    # the last box
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),          # nested braces
    ("\\boxed{7", "7"),                                 # unclosed (truncated): the last number
    ("#### \\frac{3}{4}", "\\frac{3}{4}"),
    ("the rate is 50%", "50%"),
    ("about .5 of it", ".5"),
    ("no number here", None),
    ("", None),
])
def test_extract_final_answer(text, want):
    assert extract_final_answer(text) == want


@pytest.mark.parametrize("response, answer", [
    ("The answer is \\boxed{1,234}.", "1234"),
    ("The answer is 1234", "#### 1,234"),
    ("72.00", "72"),
    ("72.", "72"),
    ("+72", "72"),
    ("It costs $1,000.", "1000"),
    ("\\boxed{\\$18}", "18"),
    ("\\boxed{18 \\text{ dollars}}", "18"),
    ("-3", "-3"),
    ("-3.50", "-3.5"),
    ("so 3/4", "0.75"),
    ("\\boxed{\\dfrac{3}{4}}", "3/4"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("a 40% discount", "40"),
    ("12 apples, then 30, so 42", "42"),
    ("Tom has 17 + 25 = <<17+25=42>>42 apples.\n#### 42", "Tom has 17 + 25 = <<17+25=42>>42 apples.\n#### 42"),
])
def test_gsm8k_right(response, answer):
    assert gsm8k("q", response, answer, DONE) == 1.0


@pytest.mark.parametrize("response, answer", [
    ("\\boxed{41} although 42", "42"),  # the box counts, not the later number
    ("42 then 43", "42"),              # the last number counts
    ("72.001", "72"),
    ("0.30000000000000004", "0.3"),    # exact comparison, not float closeness
    ("1,234", "1.234"),
    ("\\boxed{x+1}", "42"),
    ("3", "-3"),
])
def test_gsm8k_wrong(response, answer):
    assert gsm8k("q", response, answer, DONE) == 0.0
    assert gsm8k("q", response, answer, DONE, format_score=0.1) == 0.1


def test_gsm8k_no_answer_scores_zero_even_with_format_score():
    assert gsm8k("q", "I do not know.", "42", CUT, format_score=0.1) == 0.0


def test_gsm8k_on_word_problems():
    for row in word_problems(50):
        final = row["answer"].rsplit("####", 1)[1].strip()
        assert gsm8k(row["question"], row["answer"], row["answer"], DONE) == 1.0
        assert gsm8k(row["question"], f"So the answer is \\boxed{{{final}}}.", row["answer"], DONE) == 1.0
        assert gsm8k(row["question"], f"{int(final) + 1}", row["answer"], DONE) == 0.0


def test_answers_equal_text_fallback():
    assert answers_equal("\\sqrt{2}", " \\sqrt{2} ")
    assert not answers_equal("\\sqrt{2}", "\\sqrt{3}")


def test_load_reward():
    assert load_reward("dynaresize.data.rewards.gsm8k", {}) is gsm8k
    fn = load_reward("dynaresize.data.rewards.gsm8k", {"format_score": 0.25})
    assert isinstance(fn, functools.partial)
    assert fn("q", "41", "42", DONE) == 0.25 and fn("q", "42", "42", DONE) == 1.0


@pytest.mark.parametrize("target, reason", [
    ("no_such_pkg.rewards.fn", "no_such_pkg"),
    ("dynaresize.data.rewards.no_such_fn", "no_such_fn"),
    ("dynaresize.data.rewards._NUMBER", "non-callable"),
    ("gsm8k", "not a dotted path"),
])
def test_load_reward_errors(target, reason):
    with pytest.raises(ValueError) as e:
        load_reward(target, {})
    msg = str(e.value)
    assert "reward._target_" in msg and target in msg and reason in msg
    assert "importable on every rank" in msg and "dynaresize.data.rewards.gsm8k" in msg and "PYTHONPATH" in msg


def test_load_reward_bad_kwargs():
    with pytest.raises(ValueError, match=r"reward.kwargs: .*format_scor"):
        load_reward("dynaresize.data.rewards.gsm8k", {"format_scor": 0.1})


@pytest.mark.fault("a reward function that never returns",
                   "after reward.timeout_s it fails as a reward that raises: the error names the batch, prompt and "
                   "sample (on_error=fail), or the sample scores 0 and is counted (on_error=zero)")
def test_a_reward_that_never_returns_times_out_naming_the_sample():
    import time

    from dynaresize.config import RewardConfig
    from dynaresize.data.rewards import RewardError, Scorer
    from dynaresize.data.workload import Prompt

    def stuck(prompt, response, answer, extra):
        time.sleep(3600)
    prompt = Prompt(index=5, tokens=(1, 2), answer="12", response_lens=(4,), text="21=")
    import sys
    sys.modules[__name__].stuck = stuck            # importable by dotted path, as a user's reward is
    cfg = RewardConfig(_target_=f"{__name__}.stuck", timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(RewardError, match="batch 7, prompt 5, sample 3 .*did not return within reward.timeout_s=0.3 s"):
        Scorer(cfg, lambda tokens: "x", [2])(prompt, [3, 2], batch=7, sample=3)
    assert time.monotonic() - started < 5
    zero = Scorer(RewardConfig(_target_=f"{__name__}.stuck", timeout_s=0.3, on_error="zero"), lambda t: "x", [2])
    assert zero(prompt, [3, 2], batch=7, sample=3) == 0.0 and zero.take_failures() == 1
