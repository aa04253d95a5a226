"""The memory model: what one train rank holds, so that no split is chosen whose train side cannot fit.

Per train rank of a group of k, for a model of P parameters (`ModelSpec`), by the trainer's layout
(`trainer.sharding`):

- `optimizer` (the runtime's trainer today, ZeRO-1): the whole model in float32 (4P), the gradients
  in float32 (4P) plus their sum in `trainer.grad_reduce_dtype` (4P or 8P), and the float32 master
  range with AdamW's two moments (12P / k). A reference model (`trainer.kl_coef` > 0) is a whole
  float32 copy (4P).
- `full` (FSDP2, priced by the simulator; the runtime refuses it until its trainer lands):
  parameters, gradients and AdamW state all sharded in float32 (16P / k), plus the working set of
  the compute-dtype copies gathered for the layer being computed and the next (prefetch), the
  embedding and output head (the root), and one layer's unsharded gradient in the reduce dtype.
  A reference model is a sharded compute-dtype copy.

Activations of the longest micro-batch (`trainer.micro_batch_size` x the longest prompt plus
response, padded): without checkpointing every layer keeps the tensors its backward reads; with
`trainer.activation_checkpointing` a layer keeps its input only, and one layer is recomputed at a
time. The output head's logits are computed `trainer.logit_chunk_tokens` tokens at a time (0: the
whole micro-batch at once) and kept in the compute dtype plus three float32 copies (the upcast,
the log-softmax, its gradient). `hardware.train_reserved_bytes` is the rest (CUDA context, NCCL
buffers, allocator fragmentation).

Fitting is against `hardware.gpu_memory_bytes`; a profile without memory (the fitted CPU
profiles) fits everything. The rollout side (weights and KV cache) is `hardware.kv_capacity_tokens`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import HardwareProfile, ModelSpec, ProfileError

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
SHARDINGS = ("optimizer", "full")
PREFETCHED_LAYERS = 2        # FSDP2 gathers the next layer while computing this one
LOGIT_FLOAT_COPIES = 3       # float32 upcast of the logits, their log-softmax, and its gradient


@dataclass(frozen=True)
class TrainSettings:
    """What a train rank's memory depends on besides the model and the number of ranks."""
    sharding: str = "optimizer"
    compute_bytes: int = 4             # bytes of the dtype the forward/backward runs in
    reduce_bytes: int = 8              # trainer.grad_reduce_dtype
    activation_checkpointing: bool = False
    micro_batch_tokens: int = 0        # the longest micro-batch: samples x (prompt + response), padded
    logit_chunk_tokens: int = 0        # tokens whose logits exist at once; 0: the whole micro-batch
    reference_model: bool = False

    @classmethod
    def for_job(cls, cfg, model: ModelSpec) -> "TrainSettings":
        """The settings of job config `cfg` training `model` (the priced one in a simulation)."""
        from ..data.shapes import longest_sequence
        t = cfg.trainer
        full = t.sharding == "full"
        return cls(sharding=t.sharding,
                   # FSDP2 computes in the model's dtype; the ZeRO-1 trainer in its float32 flat vector
                   compute_bytes=int(model.weight_bytes) if full else 4,
                   reduce_bytes=DTYPE_BYTES.get(t.grad_reduce_dtype, 8),
                   activation_checkpointing=t.activation_checkpointing,
                   micro_batch_tokens=t.micro_batch_size * longest_sequence(cfg.workload),
                   logit_chunk_tokens=t.logit_chunk_tokens, reference_model=t.kl_coef > 0)


def job_train_side(cfg, profile: HardwareProfile) -> tuple[ModelSpec, TrainSettings]:
    """The model job config `cfg` trains as priced by `profile` (its model, else the job's own) and
    the trainer settings its memory depends on."""
    model = profile.model or ModelSpec.from_model_config(cfg.model)
    return model, TrainSettings.for_job(cfg, model)


def layer_params(m: ModelSpec) -> float:
    """Parameters of one decoder layer: the model less its untied embedding and head and final norm."""
    return max(m.params - 2.0 * m.vocab * m.hidden - m.hidden, 0.0) / max(m.layers, 1)


def layer_activation_bytes(m: ModelSpec, compute_bytes: int) -> float:
    """Bytes per token that one Qwen2 decoder layer keeps for its backward: the inputs of both norms
    and of the q/k/v and gate/up projections (4 x hidden), q, k, v and the attention output
    (flash/SDPA attention keeps no score matrix), and the MLP's gate, up, activation and product."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return compute_bytes * (4.0 * m.hidden + 2.0 * q + 3.0 * kv + 4.0 * m.intermediate)


def train_memory(m: ModelSpec, s: TrainSettings, k: int) -> dict[str, float]:
    """Bytes one of k train ranks holds at its peak, by part (see the module docstring)."""
    P, cb = float(m.params), s.compute_bytes
    if s.sharding == "full":
        states = {"parameters": 4.0 * P / k, "gradients": 4.0 * P / k, "optimizer": 8.0 * P / k}
        working = (cb * (PREFETCHED_LAYERS * layer_params(m) + 2.0 * m.vocab * m.hidden)
                   + s.reduce_bytes * layer_params(m))
        reference = cb * P / k
    else:
        states = {"parameters": 4.0 * P + 4.0 * P / k, "gradients": (4.0 + s.reduce_bytes) * P,
                  "optimizer": 8.0 * P / k}
        working, reference = 0.0, 4.0 * P
    tokens = s.micro_batch_tokens
    per_layer = layer_activation_bytes(m, cb)
    if s.activation_checkpointing:
        activations = m.layers * m.hidden * cb * tokens + per_layer * tokens
    else:
        activations = m.layers * per_layer * tokens
    logit_tokens = min(s.logit_chunk_tokens, tokens) if s.logit_chunk_tokens > 0 else tokens
    logits = logit_tokens * m.vocab * (cb + 4.0 * LOGIT_FLOAT_COPIES)
    return {**states, "working": working, "reference": reference if s.reference_model else 0.0,
            "activations": activations, "logits": logits}


def train_bytes(p: HardwareProfile, m: ModelSpec, s: TrainSettings, k: int) -> float:
    """One train rank's peak bytes with k train ranks, the profile's reserve included."""
    return sum(train_memory(m, s, k).values()) + p.train_reserved_bytes


def train_fits(p: HardwareProfile, m: ModelSpec, s: TrainSettings, k: int) -> bool:
    return not p.gpu_memory_bytes > 0 or train_bytes(p, m, s, k) <= p.gpu_memory_bytes


def min_train_ranks(p: HardwareProfile, m: ModelSpec, s: TrainSettings, most: int, unit: int = 1) -> int | None:
    """The fewest train ranks (a multiple of `unit`, at most `most`) whose train side fits; None if none."""
    unit = max(unit, 1)
    if not p.gpu_memory_bytes > 0:
        return unit
    if m.vocab <= 0:
        raise ProfileError(f"hardware.model: {m.name} has no vocab size, so its train memory cannot be priced. "
                           f"Fix: give hardware.model.vocab and .intermediate (config.json's vocab_size, "
                           f"intermediate_size)")
    fixed = train_bytes(p, m, s, 1 << 40)            # what does not shrink with more ranks
    if fixed > p.gpu_memory_bytes:
        return None
    # the sharded states fall as 1/k: start from the bound and step up past rounding
    per_rank_states = train_bytes(p, m, s, 1) - fixed
    k = max(unit, unit * math.ceil(per_rank_states / (p.gpu_memory_bytes - fixed) / unit - 1e-9))
    while k <= most and not train_fits(p, m, s, k):
        k += unit
    return k if k <= most else None


def describe(m: ModelSpec, s: TrainSettings, k: int, reserved: float) -> str:
    """The breakdown as one line in GB, for errors and the suite's notes."""
    parts = train_memory(m, s, k)
    return ", ".join(f"{name} {value / 1e9:.1f}" for name, value in parts.items() if value > 0) + \
        f", reserved {reserved / 1e9:.1f} GB"


def remedies(s: TrainSettings) -> list[str]:
    """Settings that would shrink a train rank's memory, in order of effect."""
    out = []
    if s.sharding != "full":
        out.append("trainer.sharding=full (shards parameters and gradients too)")
    if not s.activation_checkpointing:
        out.append("trainer.activation_checkpointing=true")
    if s.logit_chunk_tokens == 0 or s.logit_chunk_tokens > 4096:
        out.append("trainer.logit_chunk_tokens=2048")
    out.append("a smaller trainer.micro_batch_size (or workload.length_max)")
    return out
