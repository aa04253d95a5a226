"""Hardware profiles and the model being priced: where the cost model's coefficients come from.

A hardware profile (dynaresize/conf/hardware/NAME.yaml) gives the coefficients either *analytically* from
public hardware figures and a model size (GPU profiles: peak FLOP/s, HBM bandwidth, NVLink and
InfiniBand bandwidth, NVMe bandwidth, engine start times; MFU/MBU assumptions stated), or
*fitted* from real timelines (`python -m dynaresize.plan.calibrate`, the CPU profile). The model size
(parameters, layers, hidden size, KV heads) is an input: a GPU profile can price a 7B model while
the job itself runs the tiny model.

This module needs PyYAML only (no torch, no MPI). Over 400 lines because a profile's fields, each
with its unit and source, are most of it; they are read one by one against dynaresize/conf/hardware/*.yaml.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .. import CONF_DIR
from ..data.vocab import VOCAB_SIZE

HARDWARE_DIR = os.path.join(CONF_DIR, "hardware")


class ProfileError(ValueError):
    """A hardware profile that cannot be used; the message names the field and the fix."""


# ---------------------------------------------------------------------------------------------
# The model being priced

@dataclass
class ModelSpec:
    """Sizes of the model whose stages are priced (a Qwen2/Llama-style decoder)."""
    name: str = "model"
    params: float = 0.0            # number of parameters
    layers: int = 1
    hidden: int = 1
    heads: int = 1                 # attention (query) heads
    kv_heads: int = 1
    head_dim: int = 1
    weight_bytes: float = 2.0      # bytes per parameter in the inference engine (bf16: 2, float32: 4)
    vocab: int = 0                 # vocabulary size (the output head's logits; 0: unknown)
    intermediate: int = 0          # MLP width (the train memory's activations)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes of one token: K and V of every layer."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.weight_bytes

    @property
    def attention_flops_per_context_token(self) -> float:
        """Decode FLOPs per attended context token: q.k and p.v in every layer."""
        return 4.0 * self.layers * self.heads * self.head_dim

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
        return _build(cls, d, "model")

    @classmethod
    def from_model_config(cls, m) -> "ModelSpec":
        """The model a job runs (dynaresize.config.ModelConfig): a Hugging Face checkpoint's
        config.json when `path` is set, else the tiny Qwen2 built from the config's sizes."""
        dtype_bytes = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}.get(m.dtype, 4.0)
        if m.path:
            with open(os.path.join(m.path, "config.json")) as f:
                c = json.load(f)
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            spec = qwen2_params(vocab=int(c["vocab_size"]), hidden=hidden, layers=int(c["num_hidden_layers"]),
                                heads=heads, kv_heads=int(c.get("num_key_value_heads", heads)),
                                intermediate=int(c["intermediate_size"]),
                                tied=bool(c.get("tie_word_embeddings", False)),
                                head_dim=int(c.get("head_dim") or hidden // heads))
            return cls(name=os.path.basename(os.path.normpath(m.path)), params=spec, layers=int(c["num_hidden_layers"]),
                       hidden=hidden, heads=heads, kv_heads=int(c.get("num_key_value_heads", heads)),
                       head_dim=int(c.get("head_dim") or hidden // heads), weight_bytes=dtype_bytes,
                       vocab=int(c["vocab_size"]), intermediate=int(c["intermediate_size"]))
        head_dim = m.hidden_size // max(m.num_heads, 1)
        params = qwen2_params(vocab=VOCAB_SIZE, hidden=m.hidden_size, layers=m.num_layers, heads=m.num_heads,
                              kv_heads=m.num_kv_heads, intermediate=m.intermediate_size, tied=False,
                              head_dim=head_dim)
        return cls(name="tiny", params=float(params), layers=m.num_layers, hidden=m.hidden_size, heads=m.num_heads,
                   kv_heads=m.num_kv_heads, head_dim=head_dim, weight_bytes=dtype_bytes, vocab=VOCAB_SIZE,
                   intermediate=m.intermediate_size)


def qwen2_params(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                 tied: bool = False, head_dim: int | None = None) -> int:
    """Parameter count of a Qwen2 decoder (q/k/v with bias, o, gated MLP, RMS norms)."""
    head_dim = head_dim or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = (hidden * q + q) + 2 * (hidden * kv + kv) + q * hidden + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


# ---------------------------------------------------------------------------------------------
# Coefficients: what every prediction is made of

@dataclass
class RolloutCoef:
    base_s: float = 0.0
    per_group_s: float = 0.0
    per_step_s: float = 0.0
    per_token_s: float = 0.0
    per_kv_token_s: float = 0.0
    per_prompt_token_s: float = 0.0


@dataclass
class TrainCoef:
    base_s: float = 0.0
    per_micro_batch_s: float = 0.0
    per_token_s: float = 0.0             # forward + backward of the update, per token
    per_logprob_token_s: float = 0.0     # one forward-only log-prob pass (old-log-prob recompute, reference)
    per_inverse_rank_s: float = 0.0      # optimizer step over all parameters on one rank (divided by k)
    latency_s: float = 0.0               # per log2(k) step of a collective
    per_byte_intra_s: float = 0.0        # collective bytes inside a node
    per_byte_inter_s: float = 0.0        # collective bytes across nodes


@dataclass
class SyncCoef:
    """Broadcasts from one rank (weight sync, weight load of new train ranks, network reshard)."""
    base_s: float = 0.0
    latency_s: float = 0.0
    per_byte_intra_s: float = 0.0
    per_byte_inter_s: float = 0.0
    load_per_byte_s: float = 0.0         # weight sync only: loading the received weights into the engine


@dataclass
class ExchangeCoef:
    base_s: float = 0.0
    latency_s: float = 0.0
    per_token_s: float = 0.0             # prompt + response tokens of the batch handed over


@dataclass
class StagingCoef:
    write_base_s: float = 0.0
    write_per_byte_s: float = 0.0
    read_base_s: float = 0.0
    read_per_byte_s: float = 0.0


@dataclass
class OpsCoef:
    commit_s: float = 0.0
    group_switch_s: float = 0.0
    release_s: float = 0.0
    engine_start_s: float = 0.0          # a new engine on a rank leaving training (cold start)
    engine_wake_s: float = 0.0           # a released (sleeping) engine back: colocated, or a parked engine
    weight_load_local_s: float = 0.0     # copy the rank's own weights into its new engine ...
    weight_load_local_per_byte_s: float = 0.0   # ... plus this per byte
    drain_s: float = 0.0


@dataclass
class RunCoef:
    iteration_overhead_s: float = 0.0    # gather events, decide, broadcast: the end of every iteration
    startup_s: float = 0.0


@dataclass
class Coefficients:
    rollout: RolloutCoef = field(default_factory=RolloutCoef)
    train: TrainCoef = field(default_factory=TrainCoef)
    sync: SyncCoef = field(default_factory=SyncCoef)
    exchange: ExchangeCoef = field(default_factory=ExchangeCoef)
    staging: StagingCoef = field(default_factory=StagingCoef)
    ops: OpsCoef = field(default_factory=OpsCoef)
    run: RunCoef = field(default_factory=RunCoef)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "Coefficients":
        d = dict(d or {})
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ProfileError(f"coefficients: unknown sections {sorted(unknown)}. Fix: use "
                               f"{[f.name for f in dataclasses.fields(cls)]}")
        kw = {}
        for f in dataclasses.fields(cls):
            sub = f.default_factory()  # type: ignore[misc]
            kw[f.name] = _build(type(sub), d.get(f.name) or {}, f"coefficients.{f.name}")
        return cls(**kw)

    def flat(self) -> dict[str, float]:
        """{"rollout.per_step_s": value, ...}"""
        return {f"{sec}.{k}": v for sec, vals in self.to_dict().items() for k, v in vals.items()}


# ---------------------------------------------------------------------------------------------
# Hardware profiles

@dataclass
class HardwareProfile:
    """One machine class. `kind: analytic` derives the coefficients from the figures below and the
    model; `kind: fitted` gives them directly (`coefficients`, from dynaresize.plan.calibrate)."""
    name: str = "profile"
    kind: str = "analytic"               # analytic | fitted
    description: str = ""
    # compute (one GPU)
    peak_flops: float = 0.0              # dense BF16 FLOP/s
    hbm_bandwidth: float = 0.0           # B/s
    mfu_train: float = 0.4               # achieved / peak FLOP/s in training
    mfu_prefill: float = 0.5
    mfu_decode: float = 0.3
    mbu_decode: float = 0.7              # achieved / peak HBM bandwidth in decode
    mfu_logprob: float = 0.4             # forward-only log-prob passes (old-log-prob recompute, reference)
    decode_step_overhead_s: float = 0.0  # host-side work per decode step (scheduling, sampling)
    batching: str = "continuous"         # continuous (vLLM) | sequential (torch engine: one group at a time)
    max_num_seqs: int = 256              # sequences decoded together (continuous batching)
    # KV-cache capacity of a rollout rank: memory x utilisation - weights - reserved, over the
    # model's KV bytes per token; 0 memory: unlimited (fitted CPU profiles)
    gpu_memory_bytes: float = 0.0
    gpu_memory_utilization: float = 0.9
    engine_reserved_bytes: float = 0.0   # activations, CUDA graphs, sampler buffers of the engine
    train_reserved_bytes: float = 0.0    # a train rank's memory besides model state and activations (plan/memory.py)
    rollout_base_s: float = 0.0
    train_base_s: float = 0.0
    optimizer_bytes_per_param: float = 28.0   # AdamW in float32: read p, g, m, v; write p, m, v
    # network
    gpus_per_node: int = 8               # 0: every rank on one node
    intra_node_bandwidth: float = 0.0    # B/s per GPU, one direction
    inter_node_bandwidth: float = 0.0    # B/s per GPU, one direction
    network_efficiency: float = 1.0      # achieved / link bandwidth of collectives
    collective_latency_s: float = 0.0    # per log2(ranks) step
    control_plane_bandwidth: float = 0.0  # B/s: MPI + (de)serialisation of the sample exchange
    exchange_bytes_per_token: float = 16.0
    # storage (node-local, per GPU)
    disk_write_bandwidth: float = 0.0
    disk_read_bandwidth: float = 0.0
    staging_base_s: float = 0.0
    # engine and switch
    engine_start_s: float = 0.0
    engine_wake_s: float = 0.0
    engine_release_s: float = 0.0
    commit_s: float = 0.0
    group_switch_s: float = 0.0
    iteration_overhead_s: float = 0.0
    startup_s: float = 0.0
    # a uniform multiplier of every predicted time (emulation of a slower/faster machine); 1 = as priced
    time_scale: float = 1.0
    model: Optional[ModelSpec] = None    # None: the job's own model (ModelSpec.from_model_config)
    coefficients: Optional[Coefficients] = None   # kind=fitted
    fitted_params: float = 0.0           # kind=fitted: parameters of the model it was fitted on
    fit: dict = field(default_factory=dict)       # kind=fitted: the fit report (errors, rows, sources)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HardwareProfile":
        d = dict(d)
        model = d.pop("model", None)
        coefficients = d.pop("coefficients", None)
        fit = d.pop("fit", None) or {}
        prof = _build(cls, d, "hardware")
        prof.model = ModelSpec.from_dict(model) if model else None
        prof.coefficients = Coefficients.from_dict(coefficients) if coefficients else None
        prof.fit = dict(fit)
        prof.check()
        return prof

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["model"] = dataclasses.asdict(self.model) if self.model else None
        out["coefficients"] = self.coefficients.to_dict() if self.coefficients else None
        return out

    def check(self) -> None:
        errors = []
        if self.kind not in ("analytic", "fitted"):
            errors.append(f"hardware.kind: unknown kind {self.kind!r}. Fix: use analytic or fitted")
        if self.batching not in ("continuous", "sequential"):
            errors.append(f"hardware.batching: unknown {self.batching!r}. Fix: use continuous or sequential")
        if self.kind == "fitted" and self.coefficients is None:
            errors.append("hardware.coefficients: a fitted profile needs its coefficients. "
                          "Fix: write the profile with `python -m dynaresize.plan.calibrate`")
        if self.kind == "analytic":
            for name in ("peak_flops", "hbm_bandwidth", "mfu_train", "mfu_prefill", "mfu_decode", "mbu_decode",
                         "intra_node_bandwidth", "inter_node_bandwidth", "network_efficiency",
                         "control_plane_bandwidth", "disk_write_bandwidth", "disk_read_bandwidth"):
                if not getattr(self, name) > 0:
                    errors.append(f"hardware.{name}: is {getattr(self, name)}; an analytic profile needs a "
                                  f"positive value. Fix: give it (with its source)")
        if self.max_num_seqs < 1:
            errors.append(f"hardware.max_num_seqs: is {self.max_num_seqs}. Fix: use 1 or more")
        if self.kind == "analytic" and not self.mfu_logprob > 0:
            errors.append(f"hardware.mfu_logprob: is {self.mfu_logprob}. Fix: give a positive efficiency")
        if (self.gpu_memory_bytes < 0 or not 0 < self.gpu_memory_utilization <= 1 or self.engine_reserved_bytes < 0
                or self.train_reserved_bytes < 0):
            errors.append("hardware.gpu_memory_bytes / gpu_memory_utilization / engine_reserved_bytes / "
                          "train_reserved_bytes: need memory >= 0 (0: unlimited), 0 < utilization <= 1, "
                          "reserved >= 0. Fix: correct them")
        if self.gpus_per_node < 0:
            errors.append(f"hardware.gpus_per_node: is {self.gpus_per_node}. Fix: use 0 (one node) or more")
        if not self.time_scale > 0:
            errors.append(f"hardware.time_scale: is {self.time_scale}. Fix: use a positive factor (1 = as priced)")
        if errors:
            raise ProfileError("invalid hardware profile:\n  " + "\n  ".join(errors))


def _build(cls, d: Mapping[str, Any], where: str):
    """A dataclass from a mapping: unknown keys are errors, numbers given as strings are converted."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in d if k not in names]
    if unknown:
        raise ProfileError(f"{where}: unknown fields {unknown}. Fix: check the spelling against "
                           f"dynaresize/plan/hardware.py ({cls.__name__})")
    kw = {}
    for key, value in d.items():
        default = names[key].default
        if isinstance(default, bool):
            kw[key] = bool(value)
        elif isinstance(default, float) and value is not None:
            try:
                kw[key] = float(value)
            except (TypeError, ValueError):
                raise ProfileError(f"{where}.{key}: {value!r} is not a number") from None
        elif isinstance(default, int) and value is not None:
            kw[key] = int(float(value))
        else:
            kw[key] = value
    return cls(**kw)


def profile_path(name: str) -> str:
    return os.path.join(HARDWARE_DIR, f"{name}.yaml")


def available_profiles() -> list[str]:
    if not os.path.isdir(HARDWARE_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(HARDWARE_DIR) if f.endswith(".yaml"))


def load_profile(spec: "str | os.PathLike | Mapping | HardwareProfile") -> HardwareProfile:
    """A profile from a name (dynaresize/conf/hardware/NAME.yaml), a YAML path, a mapping, or a profile."""
    if isinstance(spec, HardwareProfile):
        return spec
    if isinstance(spec, Mapping):
        return HardwareProfile.from_dict(_plain(spec))
    import yaml
    path = os.fspath(spec)
    if not os.path.exists(path):
        path = profile_path(path)
    if not os.path.exists(path):
        raise ProfileError(f"hardware profile {spec!r} not found. Fix: use one of {available_profiles()} "
                           f"(dynaresize/conf/hardware/) or a YAML path")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    return HardwareProfile.from_dict(data)


def _plain(obj):
    """OmegaConf containers (or anything mapping-like) to plain dicts and lists."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def kv_capacity_tokens(p: HardwareProfile, m: ModelSpec) -> float:
    """Tokens of KV cache one rollout rank holds: (GPU memory x utilisation - weights - reserved)
    / KV bytes per token; infinite when the profile gives no memory (fitted CPU profiles)."""
    if not p.gpu_memory_bytes > 0:
        return math.inf
    free = p.gpu_memory_bytes * p.gpu_memory_utilization - m.params * m.weight_bytes - p.engine_reserved_bytes
    if free <= 0:
        raise ProfileError(f"hardware.gpu_memory_bytes: {p.gpu_memory_bytes:.3g} B x {p.gpu_memory_utilization} "
                           f"leaves no KV cache after {m.params * m.weight_bytes:.3g} B of weights and "
                           f"{p.engine_reserved_bytes:.3g} B reserved. Fix: a smaller model or a larger GPU")
    return free / m.kv_bytes_per_token


def analytic_coefficients(p: HardwareProfile, m: ModelSpec) -> Coefficients:
    """Coefficients from hardware figures and the model size (see dynaresize/conf/hardware/h100.yaml)."""
    P = float(m.params)
    hbm_eff = p.hbm_bandwidth * p.mbu_decode
    net = p.network_efficiency
    return Coefficients(
        rollout=RolloutCoef(
            base_s=p.rollout_base_s,
            per_group_s=0.0,
            # every decode step reads all weights once (memory-bound) plus host work per step
            per_step_s=P * m.weight_bytes / hbm_eff + p.decode_step_overhead_s,
            per_token_s=2.0 * P / (p.peak_flops * p.mfu_decode),
            per_kv_token_s=(m.kv_bytes_per_token / hbm_eff
                            + m.attention_flops_per_context_token / (p.peak_flops * p.mfu_decode)),
            per_prompt_token_s=2.0 * P / (p.peak_flops * p.mfu_prefill)),
        train=TrainCoef(
            base_s=p.train_base_s,
            per_micro_batch_s=0.0,
            per_token_s=6.0 * P / (p.peak_flops * p.mfu_train),           # forward 2P + backward 4P
            per_logprob_token_s=2.0 * P / (p.peak_flops * p.mfu_logprob),  # forward only
            per_inverse_rank_s=P * p.optimizer_bytes_per_param / p.hbm_bandwidth,
            latency_s=p.collective_latency_s,
            per_byte_intra_s=1.0 / (p.intra_node_bandwidth * net),
            per_byte_inter_s=1.0 / (p.inter_node_bandwidth * net)),
        sync=SyncCoef(
            base_s=0.0,
            latency_s=p.collective_latency_s,
            per_byte_intra_s=1.0 / (p.intra_node_bandwidth * net),
            per_byte_inter_s=1.0 / (p.inter_node_bandwidth * net),
            load_per_byte_s=1.0 / p.hbm_bandwidth),
        exchange=ExchangeCoef(
            base_s=0.0,
            latency_s=p.collective_latency_s,
            per_token_s=p.exchange_bytes_per_token / p.control_plane_bandwidth),
        staging=StagingCoef(
            write_base_s=p.staging_base_s, write_per_byte_s=1.0 / p.disk_write_bandwidth,
            read_base_s=p.staging_base_s, read_per_byte_s=1.0 / p.disk_read_bandwidth),
        ops=OpsCoef(
            commit_s=p.commit_s, group_switch_s=p.group_switch_s, release_s=p.engine_release_s,
            engine_start_s=p.engine_start_s, engine_wake_s=p.engine_wake_s,
            weight_load_local_s=0.0, weight_load_local_per_byte_s=1.0 / p.hbm_bandwidth),
        run=RunCoef(iteration_overhead_s=p.iteration_overhead_s, startup_s=p.startup_s),
    )


def job_profile(cfg, hardware: Any = None) -> HardwareProfile:
    """The profile of a job: `hardware` (name, path, mapping or profile), else the config's
    `hardware` field if the schema has one, else the CPU profile of this setting (cpu_tiny)."""
    if hardware is None:
        hardware = getattr(cfg, "hardware", None)
    if hardware is None or hardware == {}:
        hardware = "cpu_tiny"
    return load_profile(hardware)
