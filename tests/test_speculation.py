"""Tail speculation in the torch engine (rollout.speculation): drafts from a group's sibling
responses, verified in one forward pass. Greedy decoding gives the tokens of plain decoding;
sampling keeps the model's distribution (chi-square tests at significance 0.001, fixed seeds, so
each test is deterministic); a group handed off while it speculates continues bit-identically."""
from __future__ import annotations

import collections
import dataclasses
import pickle

import pytest
import torch

from dynaresize.config import ModelConfig, WorkloadConfig
from dynaresize.data.model import prepare_checkpoint
from dynaresize.data.workload import make_batch
from dynaresize.runtime.rollout.base import GroupRequest, resume
from dynaresize.runtime.rollout.drafts import sibling_draft
from dynaresize.runtime.rollout.torch_engine import TorchEngine, sample_token

SIGNIFICANCE = 0.001


def chi_square_p(stat: float, dof: int) -> float:
    """P(chi-square with `dof` degrees of freedom >= stat)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def two_sample_p(a: collections.Counter, b: collections.Counter, min_count: int = 10) -> float:
    """Chi-square test that two equally large samples come from one distribution (categories with
    fewer than `min_count` observations in both together are pooled into one)."""
    assert sum(a.values()) == sum(b.values())
    cells, pooled = [], [0, 0]
    for key in set(a) | set(b):
        if a[key] + b[key] >= min_count:
            cells.append((a[key], b[key]))
        else:
            pooled[0] += a[key]
            pooled[1] += b[key]
    if sum(pooled) >= min_count:
        cells.append(tuple(pooled))
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    return chi_square_p(stat, len(cells) - 1)


def test_sibling_draft_takes_what_followed_the_longest_match():
    rows = [[1, 2, 3, 4, 5, 6],       # sibling: "2 3" is followed by 4 5 6
            [9, 2, 3],                # the row drafted for
            [7, 3, 8, 8]]             # only "3" matches here
    assert sibling_draft(rows, 1, k=2) == [4, 5]                  # the longer match wins
    assert sibling_draft(rows, 1, k=9) == [4, 5, 6]               # at most what follows
    assert sibling_draft([[3, 1, 3, 2, 2], [3]], 1, k=2) == [2, 2]   # the last occurrence
    assert sibling_draft([[5, 1], [5, 2, 2, 2], [5]], 2, k=3) == [2, 2, 2]   # the longest continuation
    assert sibling_draft([[5, 1], [5, 2], [5]], 2, k=3) == [1]    # a tie: the lower row
    assert sibling_draft([[1, 2, 3], [1, 2]], 1, k=0) == []
    assert sibling_draft([[4, 4, 4], [1, 2]], 1, k=3) == []       # no match
    assert sibling_draft([[1, 2, 3], [9, 9, 3]], 0, k=2) == []    # its own tokens are not a source
    assert sibling_draft([[1, 2, 3], [3]], 1, k=2) == []          # a match must have a token after it


@pytest.mark.parametrize("draft", [None, 23, 10, 21])     # none, the likeliest (0.53), 0.13, 0.037
def test_a_draw_against_a_draft_keeps_the_distribution(draft):
    """sample_token with a draft token first in the CDF: 20,000 draws (one seed each) against the
    softmax's probabilities; the draft token is drawn with its own probability (a draw that took
    it 15 % more often fails both checks)."""
    logits = torch.randn(24, generator=torch.Generator().manual_seed(1)) * 1.5
    probs = torch.softmax(logits.double(), -1)
    n = 20_000
    counts = torch.zeros(24, dtype=torch.float64)
    for seed in range(n):
        token, logprob = sample_token(logits, torch.Generator().manual_seed(seed), 1.0, draft)
        counts[token] += 1
    assert abs(logprob - float(torch.log(probs[token]))) < 1e-5
    expected = n * probs
    keep = expected >= 5                                  # chi-square's rule of thumb; pool the rest
    observed = torch.cat((counts[keep], counts[~keep].sum().reshape(1)))
    expected = torch.cat((expected[keep], expected[~keep].sum().reshape(1)))
    cells = expected > 0
    stat = float(((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    assert chi_square_p(stat, int(cells.sum()) - 1) > SIGNIFICANCE, stat
    if draft is not None:                                 # P(draft) within 4 standard deviations
        p = float(probs[draft])
        assert abs(counts[draft] / n - p) < 4 * (p * (1 - p) / n) ** 0.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return prepare_checkpoint(ModelConfig(), str(tmp_path_factory.mktemp("speculation") / "model"))


def sharpened(engine: TorchEngine, factor: float) -> TorchEngine:
    """The engine with its output layer scaled by `factor`: a peaked distribution, as a trained
    model's, so that siblings repeat each other and drafts are often right."""
    engine.load_weights([("lm_head.weight", engine.model.lm_head.weight * factor)])
    return engine


def requests(lengths, groups: int = 6, seed0: int = 100) -> list[GroupRequest]:
    rows = len(lengths)
    return [GroupRequest(dataclasses.replace(p, response_lens=tuple(lengths)),
                         tuple(seed0 + rows * i + j for j in range(rows)), first_index=rows * i)
            for i, p in enumerate(make_batch(WorkloadConfig(), 1234, 0, groups, 1))]


@pytest.mark.parametrize("mode", ["tail", "always"])
def test_greedy_speculation_gives_the_tokens_of_plain_decoding(checkpoint, mode):
    """Temperature 0, rows of different lengths (so some rows speculate alone at the tail): the
    same tokens, log-probabilities within 1e-5; drafts were both accepted and rejected."""
    batch = requests((40, 25, 60, 10))
    plain = TorchEngine(checkpoint).generate(batch, 0.0)
    engine = TorchEngine(checkpoint, speculation=mode, speculation_tokens=4, speculation_below=2)
    spec = engine.generate(batch, 0.0)
    for p_group, s_group in zip(plain, spec):
        for p, s in zip(p_group, s_group):
            assert p.tokens == s.tokens
            assert max(abs(x - y) for x, y in zip(p.logprobs, s.logprobs)) < 1e-5
    stats = engine.take_stats()
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"], stats
    assert engine.take_stats() == dict.fromkeys(stats, 0)            # counts since the last call


def test_sampling_with_speculation_keeps_the_distribution(checkpoint):
    """Temperature 1 on a peaked model: 300 groups of 4 responses of 6 tokens with and without
    speculation (other seeds), tested against each other: the tokens at each of the last 4
    positions, and how many distinct responses a group has (drafts come from the siblings: a draw
    biased towards them would make a group's responses alike)."""
    plain = sharpened(TorchEngine(checkpoint, ignore_eos=True), 20.0)
    spec = sharpened(TorchEngine(checkpoint, ignore_eos=True, speculation="always"), 20.0)
    prompt = dataclasses.replace(make_batch(WorkloadConfig(), 1234, 0, 1, 1)[0], response_lens=(6,) * 4)

    def batch(seed0):                # independent samples: other seeds for each run
        return [GroupRequest(prompt, tuple(range(seed0 + 4 * i, seed0 + 4 * i + 4)), 4 * i) for i in range(300)]

    groups = {name: [[tuple(g.tokens) for g in group] for group in engine.generate(batch(seed0), 1.0)]
              for name, engine, seed0 in (("plain", plain, 0), ("spec", spec, 10_000))}
    samples = {name: [tokens for group in gs for tokens in group] for name, gs in groups.items()}
    stats = spec.take_stats()
    assert stats["accepted_tokens"] >= 0.2 * stats["draft_tokens"] > 0, stats    # drafts matter here
    for position in range(2, 6):
        counts = {name: collections.Counter(t[position] for t in s) for name, s in samples.items()}
        assert two_sample_p(counts["plain"], counts["spec"]) > SIGNIFICANCE, position
    distinct = {name: collections.Counter(len(set(group)) for group in gs) for name, gs in groups.items()}
    assert two_sample_p(distinct["plain"], distinct["spec"]) > SIGNIFICANCE, distinct


def test_a_group_handed_off_while_speculating_continues_bit_identically(checkpoint):
    """Tail migration from a speculating group (every threshold of a rank's sequences): the source's
    finished groups plus what another engine resumes from the pickled hand-offs are exactly an
    uninterrupted run with speculation."""
    make = lambda: sharpened(TorchEngine(checkpoint, speculation="tail", speculation_below=3), 10.0)  # noqa: E731
    source, tail = make(), make()
    batch = requests((30, 12, 45, 20), groups=3)
    expected = [[(g.tokens, g.logprobs) for g in group] for group in source.generate(batch, 1.0)]
    speculating = 0
    for threshold in range(0, 13):
        finished, handoffs = source.generate_until(batch, 1.0, threshold)
        handoffs = pickle.loads(pickle.dumps(handoffs))                # as sent over MPI
        speculating += sum(h.state is not None and h.state["mask"] is not None for h in handoffs)
        got = [gens for _, gens in finished] + resume(tail, handoffs, 1.0)
        assert [[(g.tokens, g.logprobs) for g in group] for group in got] == expected, threshold
    assert speculating > 0, "no threshold handed off a speculating group"


def test_speculation_with_resizes_and_tail_migration_keeps_the_rl_exact(tmp_path):
    """4 real ranks, synchronous: a static 2/2 run against resizes between 1 and 2 train ranks with
    tail migration, both speculating at the tail: the same samples and bit-identical final weights
    (whether a group speculates depends on the group alone, and it moves with its drafts' state)."""
    from conftest import run_cli
    from test_resize import assert_same_rl

    from dynaresize import analysis

    spec = ["rollout.speculation=tail", "rollout.speculation_below=3", "run.max_lag=0", "run.iterations=4"]
    run_cli(tmp_path / "static", "policy.train_ranks=2", *spec)
    run_cli(tmp_path / "moving", "policy=scripted", "policy.schedule=[1,2,1,2]", "rollout.migration_threshold=6",
            *spec)
    assert_same_rl(tmp_path / "moving", tmp_path / "static", exact=True)
    metrics = analysis.run_metrics(analysis.load_timeline(tmp_path / "moving"))
    assert metrics["resizes"] == 3 and 0 <= metrics["draft_acceptance"] <= 1 and metrics["tokens_per_verify"] >= 1
