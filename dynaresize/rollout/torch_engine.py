"""The portable rollout engine: KV-cached sampling on the Hugging Face model.

Placement invariance by construction:
- one prompt group is one forward batch of shape [group size, prompt length], always the same
  shape whatever else the rank generates, so the arithmetic of a row never depends on other work;
- each row samples from its own torch.Generator (seeded per sample) by inverse CDF, drawing
  exactly one uniform per step, so a row's tokens depend on its seed and the weights only.
(transformers' `generate` samples from the global RNG, so a row's tokens would change with the
batch composition.)
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..model import PAD_ID, cache_kwarg, eos_token_ids, load_model, trainable_parameters
from .base import Generation, GroupRequest


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
        return [self._generate_group(req, temperature) for req in requests]

    def _generate_group(self, req: GroupRequest, temperature: float) -> list[Generation]:
        """Sample every row of the group together; row j stops at an end-of-sequence token (unless
        ignore_eos) or at its length req.prompt.response_lens[j], where the workload cuts it."""
        rows = len(req.seeds)
        limits = req.prompt.response_lens
        generators = [torch.Generator().manual_seed(s) for s in req.seeds]
        input_ids = torch.tensor([req.prompt.tokens] * rows, device=self.device)
        out = self.model(input_ids=input_ids, use_cache=True)
        cache = out[1]
        tokens = [[] for _ in range(rows)]
        logprobs = [[] for _ in range(rows)]
        done = [False] * rows
        for _ in range(max(limits)):
            next_ids = []
            logits = out.logits[:, -1, :].float()
            for row in range(rows):
                token, logprob = sample_token(logits[row], generators[row], temperature)
                if not done[row]:
                    tokens[row].append(token)
                    logprobs[row].append(logprob)
                    done[row] = ((token in self.eos_ids and not self.ignore_eos) or len(tokens[row]) >= limits[row])
                next_ids.append(PAD_ID if done[row] else token)
            if all(done):
                break
            step = torch.tensor(next_ids, device=self.device).unsqueeze(1)
            out = self.model(input_ids=step, use_cache=True, **{self._cache_arg: cache})
            cache = out[1]
        return [Generation(tokens[r], logprobs[r]) for r in range(rows)]


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
