"""The portable rollout engine: KV-cached sampling on the Hugging Face model.

Placement invariance by construction:
- one prompt group is one forward batch of shape [group size, prompt length], always the same
  shape whatever else the rank generates, so the arithmetic of a row never depends on other work;
- each row samples from its own torch.Generator (seeded per sample) by inverse CDF, drawing
  exactly one uniform per step, so a row's tokens depend on its seed and the weights only.
(transformers' `generate` samples from the global RNG, so a row's tokens would change with the
batch composition.) The same holds across ranks for tail migration: a group moves with its whole
state (KV cache, generators, tokens so far) and goes on in a batch of the same shape.
"""
from __future__ import annotations

import copy
from typing import Iterable, Iterator

import torch

from ...data.model import PAD_ID, cache_kwarg, eos_token_ids, load_model, trainable_parameters
from .base import Arrivals, Generation, GroupRequest, Handoff


class TorchEngine:
    name = "torch"

    def __init__(self, checkpoint: str, dtype: str = "float32", device: str = "cpu", ignore_eos: bool = False):
        self.checkpoint, self.dtype, self.device, self.ignore_eos = checkpoint, dtype, device, ignore_eos
        self.eos_ids = set(eos_token_ids(checkpoint))
        self.model = None
        self.restore()

    @classmethod
    def from_config(cls, cfg, checkpoint: str, dtype: str, device: str, seed: int) -> "TorchEngine":
        """make_engine's constructor (the seed is per sample: GroupRequest.seeds)."""
        return cls(checkpoint, dtype=dtype, device=device, ignore_eos=cfg.ignore_eos)

    def restore(self) -> None:
        if self.model is None:
            self.model = load_model(self.checkpoint, self.dtype, self.device).eval()
            self._cache_arg = cache_kwarg(self.model)

    def release(self) -> None:
        self.model = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.release()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(trainable_parameters(self.model))
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in trainable_parameters(self.model)]

    @torch.no_grad()
    def generate(self, requests: list[GroupRequest], temperature: float) -> list[list[Generation]]:
        return [self._run(_GroupRun.start(self, req, temperature)) for req in requests]

    @torch.no_grad()
    def generate_until(self, requests: list[GroupRequest], temperature: float,
                       threshold: int) -> tuple[list[tuple[GroupRequest, list[Generation]]], list[Handoff]]:
        """Generate the groups in order until `threshold` or fewer sequences are left (unfinished
        rows of the group running and every row of the groups not started): those groups are
        handed off, the running one with its whole state (KV cache, generators, tokens so far).
        Returns the finished groups and the handoffs (none if the rank never got that low)."""
        finished: list[tuple[GroupRequest, list[Generation]]] = []
        later = sum(len(req.seeds) for req in requests)
        for i, req in enumerate(requests):
            later -= len(req.seeds)
            if later + len(req.seeds) <= threshold:
                return finished, [_not_started(r) for r in requests[i:]]
            run = _GroupRun.start(self, req, temperature)
            while not run.finished:
                if later + run.running <= threshold:
                    return finished, [run.handoff()] + [_not_started(r) for r in requests[i + 1:]]
                run.step()
            finished.append((req, run.generations()))
        return finished, []

    @torch.no_grad()
    def continue_tail(self, arrivals: Arrivals, temperature: float) -> Iterator[tuple[Handoff, list[Generation]]]:
        """Finish groups other ranks handed off, each taken up as it arrives: every running group
        steps one token a round, in a batch of its own shape with its own cache and generators,
        so its rows continue exactly where they stopped and their tokens and log-probs are
        bit-identical to an uninterrupted run's, whatever else runs beside them."""
        runs: list[tuple[Handoff, _GroupRun]] = []
        more = True
        while more or runs:
            if more:
                arrived = arrivals.poll(wait=not runs)
                if arrived is None:
                    more = False
                else:
                    runs += [(h, _GroupRun.start(self, h.request, temperature) if h.state is None
                              else _GroupRun.restored(self, h.request, temperature, h.state)) for h in arrived]
            going = []
            for h, run in runs:
                run.step()
                if run.finished:
                    yield h, run.generations()
                else:
                    going.append((h, run))
            runs = going

    @staticmethod
    def _run(run: "_GroupRun") -> list[Generation]:
        while not run.finished:
            run.step()
        return run.generations()


class _GroupRun:
    """One prompt group's generation, step by step: every row of the group together, in a batch of
    the same shape at every step; row j stops at an end-of-sequence token (unless ignore_eos) or at
    its length req.prompt.response_lens[j], where the workload cuts it."""

    def __init__(self, engine: TorchEngine, req: GroupRequest, temperature: float, logits, cache,
                 generators, tokens, logprobs, done):
        self.engine, self.req, self.temperature = engine, req, temperature
        self.logits, self.cache, self.generators = logits, cache, generators
        self.tokens, self.logprobs, self.done = tokens, logprobs, done

    @classmethod
    def start(cls, engine: TorchEngine, req: GroupRequest, temperature: float) -> "_GroupRun":
        rows = len(req.seeds)
        input_ids = torch.tensor([req.prompt.tokens] * rows, device=engine.device)
        out = engine.model(input_ids=input_ids, use_cache=True)
        return cls(engine, req, temperature, out.logits[:, -1, :].float(), out[1],
                   [torch.Generator().manual_seed(s) for s in req.seeds],
                   [[] for _ in range(rows)], [[] for _ in range(rows)], [False] * rows)

    @classmethod
    def restored(cls, engine: TorchEngine, req: GroupRequest, temperature: float, state: dict) -> "_GroupRun":
        generators = []
        for s in state["generators"]:
            g = torch.Generator()
            g.set_state(s)
            generators.append(g)
        to = engine.device
        return cls(engine, req, temperature, state["logits"].to(to), _cache_copy(state["cache"], to), generators,
                   [list(t) for t in state["tokens"]], [list(p) for p in state["logprobs"]], list(state["done"]))

    def handoff(self) -> Handoff:
        """This group for another engine to continue (the state picklable, its tensors on the CPU)."""
        state = {"logits": self.logits.cpu(), "cache": _cache_copy(self.cache, "cpu"),
                 "generators": [g.get_state() for g in self.generators],
                 "tokens": self.tokens, "logprobs": self.logprobs, "done": self.done}
        return Handoff(self.req, state, running=self.running, prefix_lens=tuple(map(len, self.tokens)))

    @property
    def running(self) -> int:
        return self.done.count(False)

    @property
    def finished(self) -> bool:
        return all(self.done)

    def step(self) -> None:
        """Sample one token on every row (every row draws its uniform, finished or not), then run
        the next forward step unless every row has finished."""
        limits, eos = self.req.prompt.response_lens, self.engine.eos_ids
        next_ids = []
        for row, generator in enumerate(self.generators):
            token, logprob = sample_token(self.logits[row], generator, self.temperature)
            if not self.done[row]:
                self.tokens[row].append(token)
                self.logprobs[row].append(logprob)
                self.done[row] = ((token in eos and not self.engine.ignore_eos) or len(self.tokens[row]) >= limits[row])
            next_ids.append(PAD_ID if self.done[row] else token)
        if self.finished:
            return
        step = torch.tensor(next_ids, device=self.engine.device).unsqueeze(1)
        out = self.engine.model(input_ids=step, use_cache=True, **{self.engine._cache_arg: self.cache})
        self.logits, self.cache = out.logits[:, -1, :].float(), out[1]

    def generations(self) -> list[Generation]:
        return [Generation(t, p) for t, p in zip(self.tokens, self.logprobs)]


def _not_started(req: GroupRequest) -> Handoff:
    return Handoff(req, None, running=len(req.seeds), prefix_lens=(0,) * len(req.seeds))


def _cache_copy(cache, device: str):
    """A copy of the KV cache with its tensors on `device` (a forward step extends a cache in place)."""
    copied = copy.copy(cache)
    copied.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        new.keys, new.values = layer.keys.to(device, copy=True), layer.values.to(device, copy=True)
        if hasattr(new, "device"):
            new.device = new.keys.device
        copied.layers.append(new)
    return copied


def sample_token(logits: torch.Tensor, generator: torch.Generator, temperature: float) -> tuple[int, float]:
    """Sample one token by inverse CDF with the row's own generator; temperature 0 is greedy.

    The uniform is always drawn, so a row consumes one number per step whatever happens.
    """
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    if temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    logp = torch.log_softmax(logits / temperature, -1)
    cdf = torch.cumsum(logp.double().exp(), 0)
    token = min(int(torch.searchsorted(cdf, u * cdf[-1].item())), logits.numel() - 1)
    return token, float(logp[token])
