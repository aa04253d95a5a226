"""The fully sharded trainer (`trainer.sharding=full`): GRPO on torch's FSDP2.

Each decoder layer and then the root are sharded (`fully_shard`) over a DeviceMesh built from the
registry's pre-created group of the split (so sharding creates no group): parameters, gradients
and AdamW state are each rank's 1/k, computed in the model's dtype with float32 master weights
and gradients reduced in `trainer.grad_reduce_dtype` (`MixedPrecisionPolicy`).

FSDP2 binds a model to its mesh, so a trainer belongs to one train group: a resize saves the old
group's state through torch.distributed.checkpoint into the node-local staging folder (dcp_h5.py;
across nodes the files are then copied to the nodes that read them, resize.ship_files) and the
new group's trainers load it, DCP computing which saved bytes fill each new shard. The same
format is the checkpoint's, so a run resumes on any number of train ranks. The rollout engines get
the weights in buckets of `trainer.weight_sync_bucket_mb`, gathered one bucket at a time
(`gathered_buckets`): no train rank holds a second full copy of the model.

A step runs the micro-batches the token-balanced assignment gives this rank; FSDP2 reduce-scatters
after every backward, so every rank runs as many passes as the busiest one: a rank with fewer runs
a one-token pass with its loss multiplied by zero for each missing slot. Gradients are summed (not
averaged) over the group, as the loss is normalised by the whole batch's tokens.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..config import TrainerConfig
from ..data.model import trainable_parameters
from .dcp_h5 import H5Reader, H5Writer
from .flat import FlatLayout
from .trainer import GRPOTrainer, group_advantages, micro_batch_tokens
from .types import Sample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def shard_model(model, group, device_type: str = "cpu", compute_dtype: str = "float32",
                reduce_dtype: str = "float32"):
    """Shard `model` (a Hugging Face causal LM, float32) in place over the ranks of `group`: one
    FSDP unit per decoder layer (gathered for its forward and backward only), and the root
    (embedding, final norm, head)."""
    mesh = DeviceMesh.from_group(group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[compute_dtype], reduce_dtype=DTYPES[reduce_dtype])
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # the root's parameters stay gathered from its forward to the backward (FSDP2's default for a
    # root, stated: the chunked output head, trainer.logit_chunk_tokens, runs after the forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for module in model.modules():      # a plain sum over the ranks, not FSDP's default mean
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)   # gloo has no PREMUL_SUM
    return model


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def held_bytes(model, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the parameters, their gradients and the optimizer's state (its
    shards of them), by the names plan/memory.py uses."""
    params = [p for p in model.parameters() if p.requires_grad]
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
    return {"parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_local_bytes(v) for v in state)}


class FullyShardedTrainer(GRPOTrainer):
    """GRPO on FSDP2 over one train group (see the module docstring). `model`: the job's model in
    float32 (its full weights, sharded here), or on the meta device when `load` or
    `scatter_weights` fills it."""

    def __init__(self, model, cfg: TrainerConfig, temperature: float, device: str, group,
                 group_ranks: list[int], rank: int, compute_dtype: str = "float32"):
        super().__init__(model, cfg, temperature, device)
        self.group, self.group_ranks, self.index = group, list(group_ranks), list(group_ranks).index(rank)
        device_type = "cuda" if device == "cuda" else "cpu"
        shard_model(model, group, device_type, compute_dtype, cfg.grad_reduce_dtype)
        if self.ref_model is not None:
            shard_model(self.ref_model, group, device_type, compute_dtype, cfg.grad_reduce_dtype)
        if next(model.parameters()).is_meta:      # filled by load() or scatter_weights()
            for m in (model, self.ref_model):
                if m is not None:
                    materialize(m, device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                           weight_decay=cfg.weight_decay, foreach=False)

    def resolve_pending(self) -> None:
        """Nothing arrives late: a resize loads the whole shard before the first forward."""

    def scatter_weights(self, full: dict[str, torch.Tensor] | None) -> None:
        """Fill the shards of the model (and of its KL reference) with the full weights `full`,
        a state dict the group's first rank holds (in host memory; None on the others): one
        parameter at a time, scattered over the group (DTensor's distribute_tensor, from the
        mesh's first rank), so that no other rank ever holds the model, and none more than one
        whole parameter on its device."""
        with torch.no_grad():
            for model in (self.model, self.ref_model):
                for name, p in (model.named_parameters() if model is not None else ()):
                    whole = (full[name].to(device=self.device, dtype=p.dtype) if full is not None
                             else torch.empty(p.shape, dtype=p.dtype, device=self.device))
                    p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements).to_local())

    # --- one policy update --------------------------------------------------------------------
    def compute_gradient(self, samples: list[Sample], queue=None, each=None) -> tuple[None, dict]:
        """Forward/backward of this rank's micro-batches (padding passes up to the busiest rank's
        count); FSDP2 leaves the group's summed gradient sharded in each parameter's .grad, clipped
        here by the global norm. Returns (None, info): the gradient stays in the parameters."""
        if queue is not None:
            raise RuntimeError("work stealing needs trainer.sharding=optimizer")
        micro_batches, owners = self.micro_batches(samples)
        mine = [i for i, o in enumerate(owners) if o == self.index]
        passes = max(owners.count(j) for j in range(len(self.group_ranks)))
        advantages = group_advantages(samples)
        total_tokens = sum(len(s.response) for s in samples)
        padding = [one_token(micro_batches[0][0])]
        stats: dict[str, float] = {}
        loss_sum, trained_tokens = 0.0, 0
        for slot in range(passes):
            if slot < len(mine):
                mb = micro_batches[mine[slot]]
                loss_sum += self._forward_backward(mb, advantages, total_tokens, stats)
                trained_tokens += micro_batch_tokens(mb)
                if each is not None:
                    each(mine[slot], micro_batch_tokens(mb))
            else:
                self._forward_backward(padding, advantages, total_tokens, None)
        grad_norm = clipped_norm = self._grad_norm()
        if self.cfg.grad_clip > 0 and grad_norm > self.cfg.grad_clip:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.cfg.grad_clip / (grad_norm + 1e-6))
            clipped_norm = self._grad_norm()
        return None, {"loss": loss_sum, "tokens": trained_tokens, "micro_batches": len(mine), "sums": stats,
                      "grad_norm": grad_norm, "grad_norm_clipped": clipped_norm, "helpers": []}

    def _grad_norm(self) -> float:
        """The global gradient norm: each rank's shards' squares, summed over the group (float64)."""
        local = sum((p.grad.to_local().double().pow(2).sum() for p in self.model.parameters()
                     if p.grad is not None), torch.zeros((), dtype=torch.float64, device=self.device))
        if len(self.group_ranks) > 1:
            dist.all_reduce(local, group=self.group)
        return float(local.sqrt())

    def apply_gradient(self, grad=None) -> None:
        """AdamW on this rank's shards (no gather: the next forward gathers layer by layer)."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # --- state in and out (collective over the train group) ---------------------------------
    def _state(self, optimizer: bool) -> dict:
        """The state dict DCP saves and loads: the model's shards, AdamW's if `optimizer` (none
        before the first step: asking torch for it would run a zero step that counts as one)."""
        state = {"model": get_model_state_dict(self.model)}
        if optimizer:
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        if self.ref_model is not None:       # the reference policy (the initial weights) moves too
            state["ref"] = get_model_state_dict(self.ref_model)
        return state

    def save(self, folder: str, run_id: str | None, chunk_mb: int = 4, fsync: bool = False) -> int:
        """Save this group's parameters and AdamW state into `folder` (one file per rank; `fsync`:
        on disk before it counts, for a checkpoint); the bytes of state this rank wrote."""
        state, writer = self._state(optimizer=bool(self.optimizer.state)), H5Writer(folder, run_id, chunk_mb, fsync)
        dcp.save(state, storage_writer=writer, process_group=self.group)
        return writer.bytes_written

    def load(self, folder: str, run_id: str | None) -> int:
        """Load this rank's shards of a state saved by `save` on any number of ranks; the bytes
        this rank read."""
        reader = H5Reader(folder, run_id)
        saved = reader.read_metadata().state_dict_metadata
        state = self._state(optimizer=any(key.startswith("optim.") for key in saved))
        dcp.load(state, storage_reader=reader, process_group=self.group)
        set_model_state_dict(self.model, state["model"])
        if "optim" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if self.ref_model is not None:
            set_model_state_dict(self.ref_model, state["ref"])
        return reader.bytes_read

    def gathered_buckets(self, layout: FlatLayout, buckets: list[tuple[int, int]]) -> Iterator[torch.Tensor]:
        """The full float32 weights of each bucket of `layout` (parameter index ranges), one
        bucket at a time: all-gathered over the train group (every train rank iterates)."""
        params = dict(trainable_parameters(self.model))
        for lo, hi in buckets:
            with torch.no_grad():
                yield torch.cat([params[name].full_tensor().reshape(-1).float() for name in layout.names[lo:hi]])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on train rank 0, in host memory (collective; others get {})."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def materialize(model, device: str) -> None:
    """Give a model whose parameters are on the meta device (data.model.empty_model, sharded)
    memory for them, uninitialised; its buffers (rotary frequencies: in no checkpoint) keep
    their values, which to_empty alone would drop."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def one_token(sample: Sample) -> Sample:
    """A padding pass's input: `sample` cut to one prompt and one response token."""
    return dataclasses.replace(sample, prompt_tokens=sample.prompt_tokens[:1], response=sample.response[:1],
                               logprobs=sample.logprobs[:1])


def load_full_weights(folder: str, run_id: str | None, layout: FlatLayout,
                      device: str = "cpu") -> tuple[torch.Tensor, int]:
    """The full weights of a state `FullyShardedTrainer.save` wrote, as one flat float32 vector in
    `layout`'s order (a rank joining rollout, or a rollout rank resuming, reads every file); and
    the bytes read. Needs no group: DCP plans this load on its own."""
    flat = torch.empty(layout.numel, dtype=torch.float32, device=device)
    reader = H5Reader(folder, run_id)
    with warnings.catch_warnings():      # DCP warns that a load without a group is a single process's
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": dict(layout.views(flat))}, storage_reader=reader, no_dist=True)
    return flat, reader.bytes_read
