"""The portable rollout engine: KV-cached sampling on the Hugging Face model.

Placement invariance by construction:
- one prompt group is one forward batch of shape [group size, prompt length], always the same
  shape whatever else the rank generates, so the arithmetic of a row never depends on other work;
- each row samples from its own torch.Generator (seeded per sample) by inverse CDF, drawing
  exactly one uniform per step, so a row's tokens depend on its seed and the weights only.
(transformers' `generate` samples from the global RNG, so a row's tokens would change with the
batch composition.) The same holds across ranks for tail migration: a group moves with its whole
state (KV cache, generators, tokens so far) and goes on in a batch of the same shape.

Tail speculation (rollout.speculation): once a group has `speculation_below` running rows or
fewer (`tail`), or from its first token (`always`), each step feeds every running row its last
token and a draft from its siblings (drafts.sibling_draft) in one forward pass, and samples each
position in turn while the draft holds. A row's rejected draft positions stay in the KV cache,
masked out of attention, with explicit position ids, so each row's context is exactly its own
tokens. Whether a group speculates depends on the group alone, never on the rank's other work, so
placement invariance holds. A token drawn against a draft token x uses the row's one uniform per
position on the inverse CDF with x first: it is x with probability p(x) and otherwise a draw from
the rest in proportion, so every token is still a draw from the model's distribution (greedy
decoding: the argmax, as without speculation), but a seed draws another sample than without
speculation.
"""
from __future__ import annotations

import copy
from typing import Iterable, Iterator

import torch

from ...data.model import PAD_ID, cache_kwarg, eos_token_ids, load_model, trainable_parameters
from .base import Arrivals, Generation, GroupRequest, Handoff
from .drafts import sibling_draft


# What a speculating engine counts (take_stats): verify steps of a row, draft tokens, accepted ones.
STATS = ("verify_rows", "draft_tokens", "accepted_tokens")


class TorchEngine:
    name = "torch"

    def __init__(self, checkpoint: str, dtype: str = "float32", device: str = "cpu", ignore_eos: bool = False,
                 speculation: str = "off", speculation_tokens: int = 4, speculation_below: int = 2):
        self.checkpoint, self.dtype, self.device, self.ignore_eos = checkpoint, dtype, device, ignore_eos
        self.speculation, self.speculation_tokens = speculation, speculation_tokens
        self.speculation_below = speculation_below
        self.stats = dict.fromkeys(STATS, 0)
        self.eos_ids = set(eos_token_ids(checkpoint))
        self.model = None
        self.restore()

    @classmethod
    def from_config(cls, cfg, checkpoint: str, dtype: str, device: str, seed: int) -> "TorchEngine":
        """make_engine's constructor (the seed is per sample: GroupRequest.seeds)."""
        return cls(checkpoint, dtype=dtype, device=device, ignore_eos=cfg.ignore_eos, speculation=cfg.speculation,
                   speculation_tokens=cfg.speculation_tokens, speculation_below=cfg.speculation_below)

    def speculates(self, running: int) -> bool:
        """Whether a group with `running` unfinished rows decodes with sibling drafts from now on."""
        return self.speculation == "always" or (self.speculation == "tail" and running <= self.speculation_below)

    def take_stats(self) -> dict[str, int]:
        """Speculation's counts since the last call (verify steps, draft tokens, accepted ones)."""
        stats, self.stats = self.stats, dict.fromkeys(STATS, 0)
        return stats

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
    its length req.prompt.response_lens[j], where the workload cuts it.

    Without speculation `logits` holds each row's next-token logits and the cache every token so far.
    Speculating, each running row's last token is drawn but not yet fed (the next step feeds it with
    its draft), `mask` marks the cache positions a row attends (its rejected drafts' are 0) and
    `positions` the position of each row's next fed token."""

    def __init__(self, engine: TorchEngine, req: GroupRequest, temperature: float, logits, cache,
                 generators, tokens, logprobs, done, mask=None, positions=None):
        self.engine, self.req, self.temperature = engine, req, temperature
        self.logits, self.cache, self.generators = logits, cache, generators
        self.tokens, self.logprobs, self.done = tokens, logprobs, done
        self.mask, self.positions = mask, positions

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
        logits, mask = (None if state[k] is None else state[k].to(to) for k in ("logits", "mask"))
        return cls(engine, req, temperature, logits, _cache_copy(state["cache"], to), generators,
                   [list(t) for t in state["tokens"]], [list(p) for p in state["logprobs"]], list(state["done"]),
                   mask, state["positions"])

    def handoff(self) -> Handoff:
        """This group for another engine to continue (the state picklable, its tensors on the CPU)."""
        state = {"logits": None if self.logits is None else self.logits.cpu(),
                 "cache": _cache_copy(self.cache, "cpu"),
                 "generators": [g.get_state() for g in self.generators],
                 "tokens": self.tokens, "logprobs": self.logprobs, "done": self.done,
                 "mask": None if self.mask is None else self.mask.cpu(), "positions": self.positions}
        return Handoff(self.req, state, running=self.running, prefix_lens=tuple(map(len, self.tokens)))

    @property
    def running(self) -> int:
        return self.done.count(False)

    @property
    def finished(self) -> bool:
        return all(self.done)

    def step(self) -> None:
        """Sample one token on every running row, then run the next forward step unless every row
        has finished; speculating, a verify step instead (one token or more on every running row)."""
        if self.mask is not None:
            return self._verify()
        for row in range(len(self.tokens)):
            if not self.done[row]:
                self._draw(row, self.logits[row])
        if self.finished:
            return
        if self.engine.speculates(self.running):
            # from here on a row's last token is fed with its draft, by the next (verify) step
            length = self.cache.get_seq_length()
            self.mask = torch.ones((len(self.tokens), length), dtype=torch.long, device=self.engine.device)
            self.positions, self.logits = [length] * len(self.tokens), None
            return
        next_ids = [PAD_ID if done else tokens[-1] for done, tokens in zip(self.done, self.tokens)]
        step = torch.tensor(next_ids, device=self.engine.device).unsqueeze(1)
        out = self.engine.model(input_ids=step, use_cache=True, **{self.engine._cache_arg: self.cache})
        self.logits, self.cache = out.logits[:, -1, :].float(), out[1]

    def _verify(self) -> None:
        """One forward pass over every running row's last token and its sibling draft; each row
        then draws position after position, against the draft's token, until one differs (that
        token is drawn all the same: it is the row's next last token) or the draft runs out (one
        more token drawn from the last position's logits)."""
        engine, limits = self.engine, self.req.prompt.response_lens
        drafts = {row: sibling_draft(self.tokens, row, min(engine.speculation_tokens,
                                                           limits[row] - len(self.tokens[row]) - 1))
                  for row, done in enumerate(self.done) if not done}
        width = 1 + max(map(len, drafts.values()))
        ids = torch.full((len(self.tokens), width), PAD_ID, dtype=torch.long)
        fed = torch.zeros((len(self.tokens), width), dtype=torch.long)
        for row, draft in drafts.items():
            ids[row, :1 + len(draft)] = torch.tensor([self.tokens[row][-1], *draft])
            fed[row, :1 + len(draft)] = 1
        device = engine.device
        self.mask = torch.cat((self.mask, fed.to(device)), dim=1)
        positions = torch.tensor(self.positions).unsqueeze(1) + torch.arange(width)
        out = engine.model(input_ids=ids.to(device), attention_mask=self.mask, position_ids=positions.to(device),
                           use_cache=True, **{engine._cache_arg: self.cache})
        self.cache, logits = out[1], out.logits.float()
        for row, draft in drafts.items():
            i = 0
            while True:
                guess = draft[i] if i < len(draft) else None
                token = self._draw(row, logits[row, i], guess)
                if self.done[row] or guess is None or token != guess:
                    break
                i += 1
            # the fed last token and the draft tokens accepted stay in the row's context
            self.mask[row, self.mask.shape[1] - width + i + 1:] = 0
            self.positions[row] += i + 1
            engine.stats["verify_rows"] += 1
            engine.stats["draft_tokens"] += len(draft)
            engine.stats["accepted_tokens"] += i

    def _draw(self, row: int, logits, first: int | None = None) -> int:
        """Row `row`'s next token from `logits` (speculating: against draft token `first`)."""
        token, logprob = sample_token(logits, self.generators[row], self.temperature, first)
        self.tokens[row].append(token)
        self.logprobs[row].append(logprob)
        self.done[row] = ((token in self.engine.eos_ids and not self.engine.ignore_eos)
                          or len(self.tokens[row]) >= self.req.prompt.response_lens[row])
        return token

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


def sample_token(logits: torch.Tensor, generator: torch.Generator, temperature: float,
                 first: int | None = None) -> tuple[int, float]:
    """Sample one token by inverse CDF with the row's own generator; temperature 0 is greedy.

    The uniform is always drawn, so a row consumes one number per position whatever happens.
    With `first` (a draft token), the CDF puts that token first and the others after it in their
    order: the token is `first` when the uniform falls below its probability, and otherwise falls
    in the rest in proportion to their probabilities (the same distribution; another draw).
    """
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    if temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    logp = torch.log_softmax(logits / temperature, -1)
    probs = logp.double().exp()
    cdf = torch.cumsum(probs, 0)
    target = u * cdf[-1].item()
    if first is None:
        token = int(torch.searchsorted(cdf, target))
    elif target < probs[first].item():
        token = first
    else:
        rest = target - probs[first].item()
        probs[first] = 0.0
        # the first token whose CDF exceeds the rest of the target: never `first`, now of probability 0
        token = int(torch.searchsorted(torch.cumsum(probs, 0), rest, side="right"))
    token = min(token, logits.numel() - 1)
    return token, float(logp[token])
