"""The rollout engine contract (dynaresize/runtime/rollout/base.py), one suite for every engine.

The torch engine runs in the main suite; the vLLM engine runs in the vLLM stage (tests/run_vllm.sh,
`pytest -m vllm`), with a 3-rank end-to-end test of rollout=vllm. Each test starts by loading the
weights it needs, so the tests do not depend on their order and share one engine per module.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pickle
import sys

import pytest
import torch

from conftest import ROOT, _env
from dynaresize.config import ModelConfig, RolloutConfig, WorkloadConfig
from dynaresize.data.model import BOS_ID, EOS_ID, load_model, prepare_checkpoint, trainable_parameters
from dynaresize.runtime.rollout.base import Generation, GroupRequest, make_engine, resume
from dynaresize.data.workload import DIGIT_IDS, EQUALS_ID, Prompt, make_batch

sys.path.insert(0, os.path.join(ROOT, "tests", "mpi"))
from vllm_scenarios import hf_greedy  # noqa: E402

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")]
ENGINES = [pytest.param("torch", id="torch"), pytest.param("vllm", id="vllm", marks=needs_vllm)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return prepare_checkpoint(ModelConfig(), str(tmp_path_factory.mktemp("contract") / "model"))


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, checkpoint):
    eng = make_engine(RolloutConfig(engine=request.param), checkpoint, "float32", "cpu", seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def initial(checkpoint) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in trainable_parameters(load_model(checkpoint))]


def prompts(n: int = 6, batch: int = 0) -> list[Prompt]:
    return make_batch(WorkloadConfig(), 1234, batch, n, 1)


def cap(p: Prompt) -> int:
    """The most tokens any sample of `p` may generate."""
    return max(p.response_lens)


def long_prompt(index: int = 99, digits: int = 150, length: int = 24) -> Prompt:
    """Longer than one KV-cache block: a stale prefix cache would show after a weight update."""
    g = torch.Generator().manual_seed(index)
    body = [DIGIT_IDS[int(d)] for d in torch.randint(0, 10, (digits,), generator=g)]
    return Prompt(index, (BOS_ID, *body, EQUALS_ID), "", (length,))


def group(prompt: Prompt, seeds=(11, 12, 13)) -> GroupRequest:
    """A request of len(seeds) samples, each allowed the prompt's longest hidden length."""
    prompt = dataclasses.replace(prompt, response_lens=(cap(prompt),) * len(seeds))
    return GroupRequest(prompt, tuple(seeds), first_index=0)


def perturbed(initial, checkpoint) -> tuple[list[tuple[str, torch.Tensor]], object]:
    """New weights and the Hugging Face model holding them.

    Noise on every weight, a sharper output layer (greedy decoding without near ties), and an
    <eos> row that outscores the greedy token at step 3 of the first prompt, so that at least one
    greedy response ends in <eos> at or before that step (proved below on the reference).
    """
    g = torch.Generator().manual_seed(7)
    new = {n: t + 0.5 * t.std() * torch.randn(t.shape, generator=g) for n, t in initial}
    new["lm_head.weight"] = new["lm_head.weight"] * 6
    model = load_model(checkpoint)
    model.load_state_dict(new, strict=False)
    p = prompts()[0]                                   # the first prompt of the batch tested
    tokens, _ = hf_greedy(model, list(p.tokens), cap(p))
    k = min(3, len(tokens) - 1)
    if EOS_ID not in tokens[:k + 1]:
        with torch.no_grad():
            ids = torch.tensor([list(p.tokens) + tokens[:k]])
            h = model.model(input_ids=ids).last_hidden_state[0, -1]       # after the final norm
        new["lm_head.weight"][EOS_ID] = new["lm_head.weight"][tokens[k]] + h / h.dot(h)
        model.load_state_dict(new, strict=False)
    return [(n, new[n]) for n, _ in initial], model


def as_lists(groups: list[list[Generation]]):
    return [[(g.tokens, g.logprobs) for g in grp] for grp in groups]


# --- the contract ------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_generate_with_per_sample_seeds(engine, initial):
    engine.load_weights(initial)
    batch = prompts()
    requests = [group(p, seeds=(100 + p.index, 200 + p.index, 100 + p.index, 300)) for p in batch]
    out = engine.generate(requests, 1.0)
    assert len(out) == len(requests) and all(len(grp) == 4 for grp in out)
    for p, grp in zip(batch, out):
        for g in grp:
            assert 1 <= len(g.tokens) <= cap(p) and len(g.logprobs) == len(g.tokens)
            assert all(lp <= 0 for lp in g.logprobs)
            assert EOS_ID not in g.tokens[:-1], "a response goes on after <eos>"
            assert g.tokens[-1] == EOS_ID or len(g.tokens) == cap(p), "stopped before <eos> or the cap"
        # Same seed, same sample (logprobs up to rounding: rows of one batch may round differently).
        assert grp[0].tokens == grp[2].tokens, "same seed, different tokens"
        assert max(abs(x - y) for x, y in zip(grp[0].logprobs, grp[2].logprobs)) < 1e-5
    firsts = [grp[0].tokens for grp in out] + [grp[1].tokens for grp in out]
    assert len({tuple(t) for t in firsts}) > len(firsts) // 2, "different seeds gave the same samples"
    assert as_lists(engine.generate(requests, 1.0)) == as_lists(out), "not reproducible"
    greedy = engine.generate([group(batch[0], seeds=(1, 2))], 0.0)[0]
    assert greedy[0].tokens == greedy[1].tokens, "temperature 0 must not depend on the seed"


@pytest.mark.timeout(300)
def test_each_sample_stops_at_its_hidden_length(engine, initial):
    """A sample ends at <eos> or at its own hidden length (the workload's), whichever comes first;
    the same seed with a longer limit continues the same tokens."""
    engine.load_weights(initial)
    p = dataclasses.replace(long_prompt(), response_lens=(3, 9, 6, 9))
    out = engine.generate([GroupRequest(p, (5, 5, 6, 6), first_index=0)], 1.0)[0]
    for g, limit in zip(out, p.response_lens):
        assert 1 <= len(g.tokens) <= limit
        assert g.tokens[-1] == EOS_ID or len(g.tokens) == limit
    assert out[0].tokens == out[1].tokens[:len(out[0].tokens)]          # seed 5: a prefix of itself
    assert out[2].tokens == out[3].tokens[:len(out[2].tokens)]          # seed 6


@pytest.mark.timeout(300)
def test_placement_invariance(engine, initial):
    """A request gives the same tokens alone, in a batch with others, and reordered."""
    engine.load_weights(initial)
    a, b, c, d = prompts(4, batch=3)
    target = group(a, seeds=(5, 6, 7))
    alone = engine.generate([target], 1.0)[0]
    batched = engine.generate([group(b), target, group(c, seeds=(8,))], 1.0)[1]
    reordered = engine.generate([group(d, seeds=(9, 10)), group(c), group(b, seeds=(1, 2, 3, 4)), target], 1.0)[3]
    assert as_lists([alone]) == as_lists([batched]) == as_lists([reordered])
    # A long request among short ones (different shapes and cache use in the batch).
    long = group(long_prompt(), seeds=(21, 22))
    assert as_lists(engine.generate([long], 1.0)) == as_lists(engine.generate([group(b), long], 1.0)[1:])


@pytest.mark.timeout(300)
def test_new_weights_give_the_new_models_greedy_output(engine, initial, checkpoint):
    new, model = perturbed(initial, checkpoint)
    batch = prompts() + [long_prompt()]
    requests = [group(p, seeds=(1, 2)) for p in batch]
    engine.load_weights(initial)
    before = engine.generate(requests, 0.0)             # fills the prefix cache with the old weights
    engine.load_weights(new)
    after = engine.generate(requests, 0.0)
    ended_at_eos = changed = 0
    for p, old, grp in zip(batch, before, after):
        want, want_logprobs = hf_greedy(model, list(p.tokens), cap(p))
        for g in grp:
            assert g.tokens == want, f"prompt {p.index}: engine {g.tokens} != Hugging Face {want}"
            assert max(abs(x - y) for x, y in zip(g.logprobs, want_logprobs)) < 1e-3
        changed += old[0].tokens != want
        ended_at_eos += want[-1] == EOS_ID and len(want) < cap(p)
    assert before[-1][0].tokens != after[-1][0].tokens, "the long prompt's output did not change"
    assert changed > len(batch) // 2, "the new weights changed too few outputs to tell them apart"
    assert ended_at_eos >= 1, "no response ended at <eos>: the test would not cover stopping"
    got = dict(engine.named_weights())
    for name, t in new:
        assert torch.equal(got[name].to(t.dtype), t), f"{name} differs from what was loaded"


@pytest.mark.timeout(300)
def test_release_and_restore(engine, initial, checkpoint):
    """After release, restore and load_weights the engine generates exactly what it did before."""
    new, _ = perturbed(initial, checkpoint)
    requests = [group(p) for p in prompts()] + [group(long_prompt())]
    engine.load_weights(new)
    before = as_lists(engine.generate(requests, 1.0))
    engine.release()
    engine.restore()
    if engine.name == "vllm":                            # generating on weights not sent yet is refused
        with pytest.raises(RuntimeError, match="load_weights"):
            engine.generate(requests, 1.0)
    engine.load_weights(new)
    assert as_lists(engine.generate(requests, 1.0)) == before


class OneByOne:
    """Hand-offs reaching a tail rank one at a time, with polls that bring nothing in between
    (rollout.base.Arrivals): each is admitted while the earlier ones are running."""

    def __init__(self, handoffs):
        self.waiting, self.polls = list(handoffs), 0

    def poll(self, wait: bool):
        self.polls += 1
        if not self.waiting:
            return None
        return [self.waiting.pop(0)] if wait or self.polls % 3 == 0 else []


@pytest.mark.timeout(300)
def test_a_handed_off_group_continues_where_it_stopped(engine, initial, checkpoint):
    """Tail migration: what an engine hands off (pickled, as it travels over MPI) and resumes gives
    the unmigrated greedy responses. Sampled, every token before the hand-off is the unmigrated
    one, a row handed off before its first token is the unmigrated sample, and the continuation
    is deterministic; the torch engine carries the random state over, so its responses are the
    unmigrated ones bit for bit."""
    new, _ = perturbed(initial, checkpoint)
    # <eos> scores 0 (the sharpened tokens far more): responses run to their hidden lengths,
    # which differ within a group, so that greedy rows (all alike) end apart
    new = [(n, t.clone()) for n, t in new]
    dict(new)["lm_head.weight"][EOS_ID] = 0
    engine.load_weights(new)
    requests = [GroupRequest(dataclasses.replace(p, response_lens=(n, n - 3, n - 6)), (31 + i, 41 + i, 51 + i),
                             first_index=3 * i) for i, (p, n) in enumerate(zip(prompts(4, batch=5), (20, 16, 12, 9)))]
    by_index = {r.prompt.index: r for r in requests}
    exact = engine.name == "torch"
    for temperature in (0.0, 1.0):
        reference = {r.prompt.index: as_lists([g])[0] for r, g in zip(requests, engine.generate(requests, temperature))}
        mid_sequence = 0
        for threshold in (2, 5, 3 * len(requests)):
            finished, handoffs = engine.generate_until(requests, temperature, threshold)
            assert sum(h.running for h in handoffs) <= threshold, threshold
            assert sorted([r.prompt.index for r, _ in finished] + [h.request.prompt.index for h in handoffs]) == \
                sorted(by_index), "a group was lost or duplicated"
            handoffs = pickle.loads(pickle.dumps(handoffs))
            resumed = resume(engine, handoffs, temperature)
            assert as_lists(resume(engine, handoffs, temperature)) == as_lists(resumed), "not deterministic"
            # the same hand-offs admitted one by one while the others run, as they reach a tail rank
            staggered = {id(h): g for h, g in engine.continue_tail(OneByOne(handoffs), temperature)}
            assert sorted(staggered) == sorted(map(id, handoffs)), "a hand-off was lost or finished twice"
            for h, want in zip(handoffs, as_lists(resumed)):
                for (tokens, logprobs), (want_tokens, want_logprobs) in zip(as_lists([staggered[id(h)]])[0], want):
                    if exact or temperature == 0:
                        assert tokens == want_tokens, (temperature, threshold, h.request.prompt.index)
                        assert max(abs(x - y) for x, y in zip(logprobs, want_logprobs)) <= (0.0 if exact else 1e-3)
            got = {r.prompt.index: as_lists([g])[0] for r, g in finished}
            got |= {h.request.prompt.index: as_lists([g])[0] for h, g in zip(handoffs, resumed)}
            prefix = {h.request.prompt.index: h.prefix_lens for h in handoffs}
            mid_sequence += sum(0 < n < len(want) for h in handoffs
                                for n, (want, _) in zip(h.prefix_lens, reference[h.request.prompt.index]))
            for index, rows in got.items():
                for j, ((tokens, logprobs), (want, want_logprobs)) in enumerate(zip(rows, reference[index])):
                    k = prefix[index][j] if index in prefix else len(want)
                    assert tokens[:k] == want[:k], (temperature, threshold, index, j)
                    if exact or temperature == 0 or k == 0:
                        assert tokens == want, (temperature, threshold, index, j)
                        assert max(abs(x - y) for x, y in zip(logprobs, want_logprobs)) <= (0.0 if exact else 1e-3)
                    assert len(logprobs) == len(tokens) >= 1
                    assert tokens[-1] == EOS_ID or len(tokens) == by_index[index].prompt.response_lens[j]
        assert mid_sequence > 0, f"temperature {temperature}: no row was handed off in the middle of its response"


# --- vLLM end to end ---------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
@pytest.mark.timeout(900)
def test_vllm_rollout_ranks_follow_the_trainer(tmp_path):
    """3 real MPI ranks, 1 train + 2 vLLM rollout: after training and weight syncs, the rollout
    ranks' greedy outputs equal the trainer's model's greedy decoding."""
    import subprocess

    from dynaresize.launch.local import mpiexec_command
    cmd = mpiexec_command(3) + [sys.executable, os.path.join(ROOT, "tests", "mpi", "vllm_scenarios.py"), "vllm_sync", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, f"STDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-8000:]}"
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("OK ")][-1][3:])
    print(json.dumps(result))
    assert result["samples"] == 32 and result["prompts_changed_by_training"] > 0


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
@pytest.mark.timeout(600)
def test_vllm_ngram_speculation_keeps_greedy_outputs(initial, checkpoint):
    """vLLM's own draft-free speculative decoding (rollout.engine_args.speculative_config, method
    ngram: what a vLLM rollout uses instead of rollout.speculation) on the CPU build: greedy
    outputs equal the Hugging Face model's greedy decoding after a weight update."""
    cfg = RolloutConfig(engine="vllm", engine_args={"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}})
    engine = make_engine(cfg, checkpoint, "float32", "cpu", seed=0)
    try:
        new, model = perturbed(initial, checkpoint)
        engine.load_weights(new)
        batch = prompts() + [long_prompt()]
        out = engine.generate([group(p, seeds=(1, 2)) for p in batch], 0.0)
        for p, grp in zip(batch, out):
            want, _ = hf_greedy(model, list(p.tokens), cap(p))
            assert all(g.tokens == want for g in grp), (p.index, [g.tokens for g in grp], want)
    finally:
        engine.close()
