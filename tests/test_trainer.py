"""The sharded GRPO trainer on one process (group_ranks [0]: no torch.distributed): recomputed
old log-probs, and the token-balanced micro-batch assignment."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dynaresize.config import ModelConfig, TrainerConfig
from dynaresize.data.model import BOS_ID, EOS_ID, load_model, prepare_checkpoint
from dynaresize.plan.placement import assign_micro_batches
from dynaresize.runtime.trainer import ShardedTrainer, micro_batch_tokens
from dynaresize.runtime.types import Sample

TEMPERATURE = 1.0
RESPONSE_LENS = [2, 3, 5, 40, 4, 6, 3, 25, 8, 2, 12, 3, 60, 5, 4, 7]   # long-tailed, 4 prompts x 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return prepare_checkpoint(ModelConfig(), str(tmp_path_factory.mktemp("tiny_model")))


def trainer(checkpoint: str, **cfg) -> ShardedTrainer:
    # No norm clipping: it would rescale away differences the tests look for.
    return ShardedTrainer(load_model(checkpoint), TrainerConfig(grad_clip=0.0, **cfg), TEMPERATURE)


def make_samples() -> list[Sample]:
    """16 samples of 4 prompts with varied response lengths; logprobs are placeholders (zeros)."""
    rng = np.random.default_rng(0)
    samples = []
    for i, r in enumerate(RESPONSE_LENS):
        prompt = i // 4
        prompt_tokens = [BOS_ID] + rng.integers(3, 15, 4 + prompt).tolist()
        response = rng.integers(3, 15, r - 1).tolist() + [EOS_ID]
        samples.append(Sample(0, i, prompt, 1, prompt_tokens, response, [0.0] * r, 64, float(rng.random())))
    return samples


def with_logprobs(samples: list[Sample], logprobs: list[list[float]]) -> list[Sample]:
    return [dataclasses.replace(s, logprobs=lp) for s, lp in zip(samples, logprobs)]


def own_logprobs(t: ShardedTrainer, samples: list[Sample]) -> list[list[float]]:
    """The model's log-probs of each response, one unpadded sequence at a time (unlike the padded
    micro-batches of the trainer, so they agree only up to rounding)."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_tokens + s.response])
            logp = t._token_logprobs(t.model, ids, torch.ones_like(ids))[0]
            p = len(s.prompt_tokens)
            out.append(logp[p - 1:p - 1 + len(s.response)].tolist())   # position t scores token t+1
    return out


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_recompute_ignores_the_engine_logprobs(checkpoint):
    samples = make_samples()
    t = trainer(checkpoint, recompute_logprobs=True)
    true = with_logprobs(samples, own_logprobs(t, samples))
    rng = np.random.default_rng(1)
    garbage = with_logprobs(samples, [(rng.uniform(-30, 5, len(s.response))).tolist() for s in samples])
    nan = with_logprobs(samples, [[float("nan")] * len(s.response) for s in samples])

    grad_true, info = t.compute_gradient(true)
    assert info["micro_batches"] == 4 and info["tokens"] == micro_batch_tokens(samples)
    assert torch.equal(t.compute_gradient(garbage)[0], grad_true)
    assert torch.equal(t.compute_gradient(nan)[0], grad_true)
    assert float(grad_true.abs().max()) > 0
    # Without recompute the same garbage does reach the gradient.
    off = trainer(checkpoint)
    assert rel_diff(off.compute_gradient(garbage)[0], grad_true) > 1e-2


def test_recompute_matches_on_policy_engine_logprobs(checkpoint):
    samples = make_samples()
    on, off = trainer(checkpoint, recompute_logprobs=True), trainer(checkpoint)
    behaviour = with_logprobs(samples, own_logprobs(off, samples))
    grad_on, grad_off = on.compute_gradient(behaviour)[0], off.compute_gradient(behaviour)[0]
    assert rel_diff(grad_on, grad_off) <= 1e-5
    # ... and the match is not trivial: slightly stale behaviour log-probs move the gradient.
    rng = np.random.default_rng(2)
    stale = with_logprobs(samples, [(np.array(s.logprobs) + rng.normal(0, 0.05, len(s.logprobs))).tolist()
                                    for s in behaviour])
    assert rel_diff(off.compute_gradient(stale)[0], grad_off) > 1e-3


def test_assign_micro_batches_balances_a_long_tail():
    rng = np.random.default_rng(0)
    tokens = np.maximum(1, rng.lognormal(np.log(200), 1.0, 32)).astype(int)
    for k in (2, 3, 4):
        owners = assign_micro_batches(tokens, k)
        load = np.bincount(owners, weights=tokens, minlength=k)
        assert load.max() <= tokens.sum() / k + tokens.max()
        assert owners.tolist() != [j % k for j in range(len(tokens))]
        assert load.max() <= np.bincount(np.arange(len(tokens)) % k, weights=tokens).max()   # on this list


def test_trainer_spreads_micro_batches_by_tokens(checkpoint):
    t = trainer(checkpoint)
    t.group_ranks = [0, 1, 2]          # only the assignment is computed: no collective runs
    mbs, owners = t.micro_batches(make_samples())
    assert [s.index for mb in mbs for s in mb] == list(range(len(RESPONSE_LENS)))   # fixed composition
    tokens = np.array([micro_batch_tokens(mb) for mb in mbs])
    assert owners == assign_micro_batches(tokens, 3).tolist()
    assert owners != [j % 3 for j in range(len(mbs))]


def test_training_metrics_of_a_step(checkpoint):
    """The train/* metrics from the trainer's sums: on-policy (the behaviour log-probs are the
    model's own) the ratio is 1 everywhere, nothing is clipped and KL(behaviour || policy) is 0;
    with log-probs moved by 0.5 per token the ratio is e^0.5 on every token and every token is
    clipped; the entropy lies in (0, log V]; the policy loss and the loss agree with the loss the
    gradient came from."""
    import math

    from dynaresize.analysis.metrics import train_step_metrics
    from dynaresize.runtime.trainer import batch_figures
    samples = make_samples()
    t = trainer(checkpoint, recompute_logprobs=True)
    _, info = t.compute_gradient(samples)
    m = train_step_metrics(info["sums"], {"grad_norm": info["grad_norm"], **batch_figures(samples)})
    assert m["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["train/ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert m["train/clip_fraction"] == 0.0 and abs(m["train/kl_behaviour"]) < 1e-6
    vocab = t.model.config.vocab_size
    assert 0.0 < m["train/entropy"] <= math.log(vocab) + 1e-6
    assert m["train/loss"] == pytest.approx(info["loss"], rel=1e-12)
    assert m["train/policy_loss"] == pytest.approx(info["loss"], rel=1e-6)        # no KL term (float32 sums)
    assert info["sums"]["tokens"] == sum(len(s.response) for s in samples)
    # GRPO advantages are normalised per group: mean 0; these groups all have reward variance
    assert m["train/advantage_mean"] == pytest.approx(0.0, abs=1e-9) and m["train/zero_variance_groups"] == 0.0

    off = trainer(checkpoint)
    behaviour = own_logprobs(off, samples)
    shifted = with_logprobs(samples, [[lp - 0.5 for lp in s] for s in behaviour])   # ratio e^0.5 > 1 + 0.2
    _, info = off.compute_gradient(shifted)
    m = train_step_metrics(info["sums"], {})
    assert m["train/ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-3)
    assert m["train/kl_behaviour"] == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-2)   # k3 of log r = -0.5
    positive = sum(len(s.response) for s in samples if off_advantage(samples, s) > 0)
    assert m["train/clip_fraction"] == pytest.approx(positive / info["sums"]["tokens"], abs=1e-9)

    equal = [dataclasses.replace(s, reward=1.0) if s.prompt == 0 else s for s in samples]
    assert batch_figures(equal)["zero_variance_groups"] == 0.25


def off_advantage(samples, s) -> float:
    from dynaresize.runtime.trainer import group_advantages
    return group_advantages(samples)[s.index]


@pytest.mark.parametrize("settings", [{"logit_chunk_tokens": 7}, {"activation_checkpointing": True},
                                      {"logit_chunk_tokens": 16, "activation_checkpointing": True}])
def test_memory_settings_compute_the_same_step(checkpoint, settings):
    """Chunked logits and activation checkpointing (plan/memory.py's settings) change what a train
    rank holds at once, not what it computes: the same gradient, loss and metrics up to rounding
    (float32 sums in another order), and the setting is on (checkpointing recomputes each layer)."""
    samples = make_samples()
    plain = trainer(checkpoint, kl_coef=0.1)
    grad, info = plain.compute_gradient(samples)
    other = trainer(checkpoint, kl_coef=0.1, **settings)
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in other.model.modules())
    assert checkpointed == settings.get("activation_checkpointing", False)
    grad2, info2 = other.compute_gradient(samples)
    assert rel_diff(grad2, grad) < 1e-5
    for key, value in info["sums"].items():
        assert info2["sums"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # A chunk that does not divide the tokens, and one larger than the batch, give the same log-probs.
    ids = torch.tensor([s.prompt_tokens + s.response[:2] for s in samples[:4]])
    whole = plain._token_logprobs(plain.model, ids, torch.ones_like(ids))
    for chunk in (5, 1000):
        other.cfg.logit_chunk_tokens = chunk
        assert torch.allclose(other._token_logprobs(other.model, ids, torch.ones_like(ids)), whole, atol=1e-5)
