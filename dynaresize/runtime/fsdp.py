"""Fully sharded parameters over a train group: torch's FSDP2 (`fully_shard`) on a decoder model.

The first piece of the fully sharded trainer (`trainer.sharding=full`): each decoder layer and
then the root are sharded over a DeviceMesh built from an existing process group (the registry's
pre-created group of the split, so sharding creates no group), with bf16 or float32 compute and
float32 master weights (`MixedPrecisionPolicy`). `held_bytes` measures what a rank holds of the
parameters, gradients and optimizer state: what plan/memory.py predicts. The runtime's trainer
does not use it yet (dynaresize-bench memory measures it).
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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
    fully_shard(model, mesh=mesh, mp_policy=policy)
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
