"""Scenarios with the vLLM rollout engine on real MPI ranks: `vllm_scenarios.py NAME OUT_DIR`.

Run by tests/test_engine_contract.py (marked vllm) like tests/mpi/scenarios.py: each scenario
asserts on rank 0 and prints a final `OK {json}` line there; any failure aborts all ranks.
"""
from __future__ import annotations

import time

import torch

from dynaresize.data.model import EOS_ID


@torch.no_grad()
def hf_greedy(model, prompt: list[int], cap: int) -> tuple[list[int], list[float]]:
    """The Hugging Face model's own greedy decoding: full forward passes, <eos> kept, at most `cap` tokens."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(cap):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
        if token == EOS_ID:
            break
    return tokens, logprobs


def vllm_sync(ctrl, out_dir: str) -> dict:
    """1 train rank, 2 vLLM rollout ranks: two GRPO steps with weight syncs, then the rollout ranks'
    greedy outputs equal the trainer's model's own greedy decoding, and their weights equal the
    trainer's bit for bit. With tail migration on, the rollout rank at its cut second hands its
    last sequences to the first, which re-prefills and continues them (greedy: the same tokens)."""
    from scenarios import job_config

    from dynaresize.runtime.flat import model_to_flat
    from dynaresize.runtime.job import Job
    from dynaresize.data.model import load_model
    from dynaresize.data.workload import make_batch

    t0 = time.perf_counter()
    cfg = job_config(out_dir, cluster={"ranks": 3}, policy={"train_ranks": 1},
                     rollout={"engine": "vllm", "temperature": 1.0, "migration_threshold": 6}, trainer={"lr": 1e-2})
    job = Job(cfg, ctrl)
    startup = time.perf_counter() - t0
    assert (job.engine is not None) == (ctrl.rank in (1, 2)), "ranks 1 and 2 roll out with vLLM"
    assert job.engine is None or job.engine.name == "vllm"

    for it in range(2):                         # sampled at temperature 1: GRPO has a signal
        batch = job.exchange(it, job.rollout(it, batch=it))
        job.train(it, batch)
        job.sync_weights(it)

    # The rollout ranks' weights, read back from vLLM's worker, equal the trainer's.
    mine = None
    if job.engine is not None:
        named = dict(job.engine.named_weights())
        mine = torch.cat([named[n].reshape(-1) for n in job.layout.names]).numpy()
    weights = ctrl.gather(mine)

    job.cfg.rollout.temperature = 0.0           # greedy: comparable with the trainer's model
    t1 = time.perf_counter()
    greedy = job.exchange(2, job.rollout(2, batch=2))
    greedy_s = time.perf_counter() - t1

    result = {}
    if ctrl.rank == 0:
        trained = job.trainer.flat
        initial_model = load_model(job.model_dir)
        assert not torch.equal(trained, model_to_flat(initial_model, job.layout)), "training changed nothing"
        for rank in (1, 2):
            got = torch.from_numpy(weights[rank])
            assert torch.equal(got, trained), f"rank {rank}: max diff {float((got - trained).abs().max())}"
        prompts = make_batch(cfg.workload, cfg.run.seed, 2, cfg.rollout.prompts_per_batch, cfg.rollout.samples_per_prompt)
        assert {s.rank for s in greedy} == {1, 2}, {s.rank for s in greedy}
        # each rank's own share is half the samples; the tail rank finished more
        migrated = max(sum(s.rank == r for s in greedy) for r in (1, 2)) - len(greedy) // 2
        assert migrated > 0, "no rollout rank handed anything off to the other"
        reference = {p.index: hf_greedy(job.trainer.model, list(p.tokens), max(p.response_lens)) for p in prompts}
        changed = sum(reference[p.index][0] != hf_greedy(initial_model, list(p.tokens), max(p.response_lens))[0]
                      for p in prompts)
        for s in greedy:                         # greedy: each sample is a prefix of its prompt's longest
            want, want_lp = reference[s.prompt]
            want, want_lp = want[:s.length_cap], want_lp[:s.length_cap]
            assert s.response == want, f"sample {s.index} (rank {s.rank}): vLLM {s.response} != trainer {want}"
            assert max(abs(a - b) for a, b in zip(s.logprobs, want_lp)) < 1e-3, f"sample {s.index}: logprobs"
        assert changed > 0, "the update did not change any greedy output: the comparison would prove nothing"
        result = {"samples": len(greedy), "tokens": sum(len(s.response) for s in greedy),
                  "prompts_changed_by_training": changed, "migrated_samples": migrated,
                  "startup_s": round(startup, 2),
                  "greedy_rollout_s": round(greedy_s, 2)}
    timings = ctrl.gather(job.engine.timings if job.engine is not None else None)
    if ctrl.rank == 0:
        result["engine_timings_s"] = {r: {k: round(v, 3) for k, v in t.items()} for r, t in enumerate(timings) if t}
    job.finish()
    return result


SCENARIOS = {f.__name__: f for f in (vllm_sync,)}


if __name__ == "__main__":
    from scenarios import run_scenario      # this script's folder is on sys.path
    run_scenario(SCENARIOS)
