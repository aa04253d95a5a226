"""GRPO: its loss (GRPOTrainer, shared with FSDP2's trainer in fsdp.py) and the ZeRO-1 trainer
(`trainer.sharding=optimizer`, the exact mode), the policy update of the train ranks.

In the ZeRO-1 trainer every train rank holds the full model (its parameters are views into one
flat vector) and the
optimizer state of one contiguous range of that vector only. A step:
1. the batch, sorted by sample index, is cut into micro-batches of `micro_batch_size` samples
   (fixed composition), spread over the train ranks by token count
   (`placement.assign_micro_batches`), or, with work stealing, taken from a shared queue by the
   train ranks and by rollout ranks that have finished generating (stealing.py; `help_step`: a
   helper's sum goes to the train ranks, each its range); each rank runs forward/backward on its
   own and accumulates gradients into a flat buffer in `grad_reduce_dtype` (with
   `recompute_logprobs`, the PPO ratio uses old log-probs recomputed from the rank's weights
   instead of the rollout engine's);
2. the train group sums the buffers (all-reduce; float64 by default, so the sum does not depend on
   how many ranks contributed), and the global gradient norm is clipped;
3. each rank steps `torch.optim.AdamW` on its own range, then the ranges are all-gathered back
   into the full vector.
The loss is normalised by the token count of the whole global batch, so the number of train ranks
changes who computes what, never what is computed. Resizing moves ranges (see staging.py).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ..config import TrainerConfig
from .flat import FlatLayout, bind_model_to_flat
from ..data.model import PAD_ID, trainable_parameters
from ..plan.placement import assign_micro_batches
from ..plan.switchplan import shard_range
from .types import Sample, ShardState

REDUCE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def group_advantages(samples: list[Sample]) -> dict[int, float]:
    """GRPO: reward minus the mean of its prompt group, over the group's standard deviation."""
    by_prompt: dict[int, list[Sample]] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt, []).append(s)
    adv = {}
    for group in by_prompt.values():
        rewards = torch.tensor([s.reward for s in group], dtype=torch.float64)
        normed = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        adv.update({s.index: float(a) for s, a in zip(group, normed)})
    return adv


def k3(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(q || p) per token from log-probs of tokens sampled from q:
    exp(log p - log q) - (log p - log q) - 1 (non-negative, unbiased)."""
    log_r = logp_p - logp_q
    return torch.exp(log_r) - log_r - 1


def add_step_sums(total: dict[str, float], part: dict[str, float]) -> None:
    """Add one part's sums of a train step's per-token quantities into `total` (`ratio_max`: the
    maximum), as micro-batches, ranks and helpers each hand in theirs."""
    for key, value in part.items():
        total[key] = max(total.get(key, value), value) if key.endswith("_max") else total.get(key, 0.0) + value


def differing_groups(samples: list[Sample]) -> list[int]:
    """The prompt groups of `samples` whose rewards are not all equal (GRPO learns from those
    only), in prompt order: what DAPO's dynamic sampling keeps."""
    rewards: dict[int, set[float]] = {}
    for s in samples:
        rewards.setdefault(s.prompt, set()).add(s.reward)
    return sorted(p for p, r in rewards.items() if len(r) > 1)


def batch_figures(samples: list[Sample]) -> dict[str, float]:
    """A trained batch's advantage mean and standard deviation and the share of its prompt groups
    whose rewards are all equal (zero advantage: no signal)."""
    adv = torch.tensor(list(group_advantages(samples).values()), dtype=torch.float64)
    rewards: dict[int, set[float]] = {}
    for s in samples:
        rewards.setdefault(s.prompt, set()).add(s.reward)
    return {"advantage_mean": float(adv.mean()), "advantage_std": float(adv.std(unbiased=False)),
            "zero_variance_groups": sum(len(r) == 1 for r in rewards.values()) / max(len(rewards), 1)}


def cut_micro_batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    """The batch in index order, cut into micro-batches of `size` samples (fixed composition)."""
    samples = sorted(samples, key=lambda s: s.index)
    return [samples[i:i + size] for i in range(0, len(samples), size)]


def micro_batch_tokens(mb: list[Sample]) -> int:
    """Tokens a micro-batch runs through the model (prompt and response): its share of the work."""
    return sum(len(s.prompt_tokens) + len(s.response) for s in mb)


class GRPOTrainer:
    """The GRPO loss of a micro-batch and its forward/backward, shared by both trainers: the
    ZeRO-1 trainer below and FSDP2's (fsdp.py). A subclass decides where gradients go."""

    def __init__(self, model, cfg: TrainerConfig, temperature: float, device: str = "cpu"):
        self.model, self.cfg, self.device = model.train(), cfg, device
        self.temperature = temperature if temperature > 0 else 1.0
        if cfg.activation_checkpointing:     # each decoder layer keeps its input; backward recomputes the rest
            if hasattr(model, "activation_checkpointing_enable"):      # its name from transformers 5 on
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    def train_step(self, samples: list[Sample]) -> dict:
        """One GRPO update on the global batch `samples` (every train rank passes the same list)."""
        grad, info = self.compute_gradient(samples)
        self.apply_gradient(grad)
        return info

    def _forward_backward(self, mb: list[Sample], advantages: dict[int, float], total_tokens: int,
                          stats: dict[str, float] | None) -> float:
        """Forward and backward of micro-batch `mb` (its share of the batch loss); its per-token
        sums go into `stats`. With `stats` None the pass only keeps collectives in step: its loss
        is multiplied by zero and nothing is counted (FSDP2's padding passes)."""
        # verl's old_log_prob pass: behaviour log-probs from the weights about to be updated, not
        # the engine's. Each depends on its micro-batch and the weights only (split-invariant).
        old_logp = self._old_logprobs(mb) if self.cfg.recompute_logprobs else None
        loss, mb_stats = self._micro_batch_loss(mb, advantages, total_tokens, old_logp)
        if stats is None:
            loss = loss * 0.0
        else:
            add_step_sums(stats, {**mb_stats, "loss": float(loss.detach())})
        loss.backward()
        return float(loss.detach())

    def micro_batches(self, samples: list[Sample]) -> tuple[list[list[Sample]], list[int]]:
        """The micro-batches of the batch (index order, `micro_batch_size` samples each) and the
        train rank (0..k-1) that computes each one."""
        micro_batches = cut_micro_batches(samples, self.cfg.micro_batch_size)
        owners = assign_micro_batches([micro_batch_tokens(mb) for mb in micro_batches], len(self.group_ranks))
        return micro_batches, owners.tolist()

    def _pad(self, mb: list[Sample]):
        """A micro-batch as padded tensors: token ids and attention mask [n, width], and the
        response mask and the engine's log-probs [n, width - 1], aligned with `_token_logprobs`."""
        seqs = [s.prompt_tokens + s.response for s in mb]
        width = max(len(q) for q in seqs)
        ids = torch.full((len(mb), width), PAD_ID, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(mb), width), dtype=torch.bool, device=self.device)
        engine_logp = torch.zeros((len(mb), width), device=self.device)
        for row, s in enumerate(mb):
            q, p, r = seqs[row], len(s.prompt_tokens), len(s.response)
            ids[row, :len(q)] = torch.tensor(q)
            mask[row, p:p + r] = True              # loss on response tokens only
            engine_logp[row, p:p + r] = torch.tensor(s.logprobs)
        attention = (torch.arange(width, device=self.device)[None, :] <
                     torch.tensor([len(q) for q in seqs], device=self.device)[:, None]).long()
        # Position t predicts token t+1: shift the mask and the behaviour logprobs to match.
        return ids, attention, mask[:, 1:], engine_logp[:, 1:]

    @torch.no_grad()
    def _old_logprobs(self, mb: list[Sample]) -> torch.Tensor:
        """The behaviour log-probs of `mb` under the current weights (same shapes as the loss pass)."""
        ids, attention, _, _ = self._pad(mb)
        return self._token_logprobs(self.model, ids, attention)

    def _micro_batch_loss(self, mb: list[Sample], advantages: dict[int, float], total_tokens: int,
                          old_logp: torch.Tensor | None = None):
        """This micro-batch's share of the batch loss; `old_logp` (from `_old_logprobs`) replaces
        the engine's behaviour log-probs when given."""
        ids, attention, mask, engine_logp = self._pad(mb)
        old_logp = engine_logp if old_logp is None else old_logp
        adv = torch.tensor([advantages[s.index] for s in mb], device=self.device).unsqueeze(1)
        logp, entropy = self._token_logprobs(self.model, ids, attention, entropy=True)
        ratio = torch.exp(logp - old_logp)
        clipped = torch.clamp(ratio, 1 - self.cfg.clip_ratio, 1 + self.cfg.clip_ratio)
        unclipped_loss, clipped_loss = -ratio * adv, -clipped * adv
        policy_loss = torch.maximum(unclipped_loss, clipped_loss)
        per_token = policy_loss
        kl_ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp = self._token_logprobs(self.ref_model, ids, attention)
            kl_ref = k3(ref_logp, logp)
            per_token = per_token + self.cfg.kl_coef * kl_ref
        with torch.no_grad():            # the training metrics: sums over this micro-batch's response tokens
            m = mask.to(policy_loss.dtype)
            sums = {"tokens": float(m.sum()), "policy_loss": float((policy_loss * m).sum()),
                    "kl_behaviour": float((k3(old_logp, logp) * m).sum()),
                    "entropy": float((entropy * m).sum()),
                    "clipped": float(((clipped_loss > unclipped_loss) * m).sum()),
                    "ratio": float((ratio * m).sum()),
                    "ratio_max": float(ratio[mask].max()) if bool(mask.any()) else 0.0}
            if kl_ref is not None:
                sums["kl_ref"] = float((kl_ref * m).sum())
        return (per_token * mask).sum() / total_tokens, sums

    def _token_logprobs(self, model, ids, attention, entropy: bool = False):
        """Log-probabilities of each next token under `model` (at the sampling temperature); with
        `entropy`, also the entropy of each next-token distribution (not differentiated).

        With `trainer.logit_chunk_tokens`, the output head runs that many tokens at a time, each
        chunk under activation checkpointing, so that only one chunk's logits (vocabulary-wide,
        in float32) exist at once, forward or backward (a Qwen2/Llama head: logits = lm_head(h)).
        The decoder's output is taken from a forward of the whole model that computes one
        position's logits: FSDP2 gathers the embedding, final norm and head, which its root unit
        holds, in the root's forward (and keeps them gathered until the backward)."""
        chunk, targets = self.cfg.logit_chunk_tokens, ids[:, 1:]
        if chunk <= 0:
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            return self._head_logprobs(logits, targets, entropy)
        decoded = []
        hook = model.get_decoder().register_forward_hook(lambda _m, _a, out: decoded.append(out.last_hidden_state))
        try:
            model(input_ids=ids, attention_mask=attention, logits_to_keep=1)
        finally:
            hook.remove()
        hidden = decoded[0][:, :-1]
        flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        head = model.get_output_embeddings()
        parts = [checkpoint(lambda h, t: self._head_logprobs(head(h), t, entropy), flat_h[i:i + chunk],
                            flat_t[i:i + chunk], use_reentrant=False) for i in range(0, len(flat_t), chunk)]
        if not entropy:
            return torch.cat(parts).view(targets.shape)
        return (torch.cat([t for t, _ in parts]).view(targets.shape),
                torch.cat([e for _, e in parts]).view(targets.shape))

    def _head_logprobs(self, logits, targets, entropy: bool):
        """Log-probabilities of `targets` under `logits` (and, with `entropy`, the entropies)."""
        logp = torch.log_softmax(logits.float() / self.temperature, -1)
        taken = torch.gather(logp, -1, targets.unsqueeze(-1)).squeeze(-1)
        if not entropy:
            return taken
        with torch.no_grad():
            return taken, -(logp.exp() * logp).sum(-1)


class ShardedTrainer(GRPOTrainer):
    def __init__(self, model, cfg: TrainerConfig, temperature: float, device: str = "cpu"):
        super().__init__(model, cfg, temperature, device)
        self.layout = FlatLayout.of(model)
        self.flat = torch.zeros(self.layout.numel, dtype=torch.float32, device=device)
        bind_model_to_flat(model, self.layout, self.flat)
        self.reduce_dtype = REDUCE_DTYPES[cfg.grad_reduce_dtype]
        self.group, self.group_ranks, self.index = None, [0], 0
        self.shard: ShardState | None = None
        self.optimizer: torch.optim.AdamW | None = None
        self._pending = None

    def resolve_pending(self) -> None:
        """Wait for a shard being staged in (if any) and install it."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._install(pending.wait())

    # --- membership -------------------------------------------------------------------------
    def join(self, group, group_ranks: list[int], my_rank: int, shard: ShardState | None = None,
             pending=None) -> None:
        """Become train rank `group_ranks.index(my_rank)` of `group`, owning `shard` (fresh if None).

        `pending` (an object with .wait() -> ShardState) delivers the shard later: a resize stages
        it in while this rank already computes gradients; it is needed only at the optimizer step.
        """
        self.group, self.group_ranks, self.index = group, list(group_ranks), group_ranks.index(my_rank)
        self._pending = pending
        if pending is not None:
            self.shard, self.optimizer = None, None
            return
        self._install(shard)

    def _install(self, shard: ShardState | None) -> None:
        lo, hi = self.my_range()
        if shard is None:
            shard = ShardState(lo, hi, self.flat[lo:hi].clone(), torch.zeros(hi - lo, device=self.device),
                               torch.zeros(hi - lo, device=self.device), 0)
        assert (shard.lo, shard.hi) == (lo, hi), f"shard {shard.lo}:{shard.hi} is not my range {lo}:{hi}"
        self.shard = shard
        self._make_optimizer()

    def my_range(self, shards: int | None = None, index: int | None = None) -> tuple[int, int]:
        shards = len(self.group_ranks) if shards is None else shards
        return shard_range(self.layout.numel, shards, self.index if index is None else index)

    def _make_optimizer(self) -> None:
        s, c = self.shard, self.cfg
        master = s.params.requires_grad_(True)
        self.optimizer = torch.optim.AdamW([master], lr=c.lr, betas=tuple(c.betas), eps=c.eps,
                                           weight_decay=c.weight_decay, foreach=False)
        if s.step > 0:
            self.optimizer.state[master] = {"step": torch.tensor(float(s.step)), "exp_avg": s.exp_avg,
                                            "exp_avg_sq": s.exp_avg_sq}

    def leave(self) -> None:
        """Leave the train group (its optimizer state staged out): the model and its weights stay,
        e.g. for a rollout rank to compute stolen micro-batches with (stealing.py)."""
        self.group, self.group_ranks, self.index = None, [0], 0
        self.shard = self.optimizer = self._pending = None

    def export_shard(self) -> ShardState:
        """The optimizer state of this rank's range, e.g. to stage it out when leaving training."""
        self.resolve_pending()
        master = self.shard.params
        state = self.optimizer.state.get(master, {})
        step = int(state["step"].item()) if "step" in state else 0
        zeros = torch.zeros_like(master)
        return ShardState(self.shard.lo, self.shard.hi, master.detach(),
                          state.get("exp_avg", zeros), state.get("exp_avg_sq", zeros), step)

    # --- one policy update --------------------------------------------------------------------
    def compute_gradient(self, samples: list[Sample], queue=None, each=None) -> tuple[torch.Tensor, dict]:
        """The clipped gradient of the whole batch, summed over the train group (same on every rank).

        `queue` (stealing.MicroBatchQueue): take micro-batches from the step's shared queue instead
        of the fixed assignment, and add to this rank's range the sums of the helpers that took some.
        `each(index, tokens)` is called after each micro-batch (the timeline, emulation)."""
        if queue is None:
            micro_batches, owners = self.micro_batches(samples)
            taken = (i for i, o in enumerate(owners) if o == self.index)
        else:
            micro_batches, taken = cut_micro_batches(samples, self.cfg.micro_batch_size), iter(queue)
        grad, info = self._accumulate(samples, micro_batches, taken, each)
        helpers = queue.helpers(self.group_ranks) if queue is not None else []
        if helpers:                        # each helper sends this rank its range of its sum
            lo, hi = self.my_range()
            parts = [torch.empty(hi - lo, dtype=grad.dtype, device=grad.device) for _ in helpers]
            for work in [dist.irecv(part, src=h) for part, h in zip(parts, helpers)]:
                work.wait()
            for part in parts:             # in rank order, whichever arrived first
                grad[lo:hi] += part
        if len(self.group_ranks) > 1:
            dist.all_reduce(grad, group=self.group)
        grad_norm = clipped_norm = float(grad.norm())
        if self.cfg.grad_clip > 0 and grad_norm > self.cfg.grad_clip:
            grad.mul_(self.cfg.grad_clip / (grad_norm + 1e-6))
            clipped_norm = float(grad.norm())
        return grad.to(torch.float32), {**info, "grad_norm": grad_norm, "grad_norm_clipped": clipped_norm,
                                        "helpers": helpers}

    def help_step(self, samples: list[Sample], queue, train_ranks: list[int], each=None) -> dict:
        """Work stealing, on a rank outside the train group: the gradients of the micro-batches it
        takes from `queue`, summed; if it took any, each train rank (global ranks `train_ranks`)
        gets its range of the sum (the ranges of the optimizer shards)."""
        micro_batches = cut_micro_batches(samples, self.cfg.micro_batch_size)
        grad, info = self._accumulate(samples, micro_batches, iter(queue), each)
        if info["micro_batches"]:
            k = len(train_ranks)
            ranges = [shard_range(self.layout.numel, k, j) for j in range(k)]
            for work in [dist.isend(grad[lo:hi], dst=r) for (lo, hi), r in zip(ranges, train_ranks)]:
                work.wait()
        return info

    def _accumulate(self, samples: list[Sample], micro_batches: list[list[Sample]], taken, each):
        """Forward/backward of the micro-batches `taken` (indices), gradients summed into a flat
        buffer in grad_reduce_dtype; the loss is normalised by the whole batch's tokens."""
        advantages = group_advantages(samples)
        total_tokens = sum(len(s.response) for s in samples)
        grad = torch.zeros(self.layout.numel, dtype=self.reduce_dtype, device=self.device)
        loss_sum, trained_tokens, count = 0.0, 0, 0
        stats: dict[str, float] = {}
        for i in taken:
            mb = micro_batches[i]
            loss_sum += self._forward_backward(mb, advantages, total_tokens, stats)
            for (_, view), (_, p) in zip(self.layout.views(grad), trainable_parameters(self.model)):
                if p.grad is not None:
                    view.add_(p.grad.to(self.reduce_dtype))
                    p.grad = None
            trained_tokens += micro_batch_tokens(mb)
            count += 1
            if each is not None:
                each(i, micro_batch_tokens(mb))
        return grad, {"loss": loss_sum, "tokens": trained_tokens, "micro_batches": count, "sums": stats}

    def apply_gradient(self, grad: torch.Tensor) -> None:
        """AdamW on this rank's range of `grad`, then all-gather the ranges into the full weights."""
        self.resolve_pending()
        master = self.shard.params
        master.grad = grad[self.shard.lo:self.shard.hi].clone()
        self.optimizer.step()
        master.grad = None
        self._gather_flat()

    def _gather_flat(self) -> None:
        """All-gather every rank's updated range into the full flat vector."""
        k = len(self.group_ranks)
        if k == 1:
            self.flat.copy_(self.shard.params.detach())
            return
        size = -(-self.layout.numel // k)
        mine = torch.zeros(size, device=self.device)
        mine[: self.shard.hi - self.shard.lo] = self.shard.params.detach()
        parts = [torch.empty(size, device=self.device) for _ in range(k)]
        dist.all_gather(parts, mine, group=self.group)
        self.flat.copy_(torch.cat(parts)[: self.layout.numel])
