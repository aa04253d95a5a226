"""Typed configuration, checked before any rank starts.

Hydra composes dynaresize/conf/ into a DictConfig; `parse_config` merges it onto these dataclasses (so a
wrong type is reported with its field) and the launcher's `launch.validate` checks the values that
types cannot express. Every error names the field and the fix. This module imports nothing of the
project's own: every layer may read the configuration.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# dynaresize/conf/cluster/slurm.yaml: ranks = nodes x gpus_per_node
OmegaConf.register_new_resolver("multiply", lambda a, b: int(a) * int(b), replace=True)


class ConfigError(ValueError):
    """One or more invalid configuration values; the message lists each field and its fix."""


@dataclass
class ClusterConfig:
    launcher: str = "local"        # local (mpiexec here), srun (inside an allocation), slurm (submitit)
    ranks: int = 4                 # local: number of MPI ranks; slurm: nodes * gpus_per_node
    device: str = "cpu"            # cpu (gloo) or cuda (nccl, one GPU per rank)
    mpiexec: str = "mpiexec"       # the MPI launcher used by launcher=local
    mpiexec_args: list[str] = field(default_factory=list)  # extra arguments to mpiexec (e.g. [--bind-to, none])
    local_scratch: Optional[str] = None  # node-local dir for staging; default $SLURM_TMPDIR/$TMPDIR/tmp
    # Slurm (launcher=slurm)
    nodes: int = 1                 # Slurm nodes of the job
    gpus_per_node: int = 4         # GPUs, and so ranks, per node
    cpus_per_task: int = 1         # CPU cores per rank (give spare ones to policy.pricing_workers)
    mem_gb: Optional[int] = None   # memory per node in GB; None: the partition's default
    partition: Optional[str] = None  # Slurm partition; None: the site's default
    account: Optional[str] = None  # Slurm account to charge
    qos: Optional[str] = None      # Slurm quality of service
    time_min: int = 60             # time limit of the job in minutes
    signal_delay_s: int = 120      # Slurm warns this long before the time limit
    max_requeues: int = 3          # requeues after Slurm's warning per submission; then checkpoint and stop
    mpi: str = "pmix"              # srun --mpi plugin
    sbatch_extra: dict[str, Any] = field(default_factory=dict)  # other sbatch options: +cluster.sbatch_extra.KEY=V
    setup: list[str] = field(default_factory=list)  # shell lines run before the job (module load ...)
    wait: bool = True              # follow the submitted job until it ends


@dataclass
class ModelConfig:
    path: Optional[str] = None     # a Hugging Face checkpoint dir; None builds the tiny model below
    hidden_size: int = 128         # the tiny model's hidden size (model.path unset)
    num_layers: int = 2            # the tiny model's decoder layers
    num_heads: int = 4             # the tiny model's attention heads
    num_kv_heads: int = 2          # the tiny model's key/value heads (grouped-query attention)
    intermediate_size: int = 256   # the tiny model's MLP width
    max_position: int = 256        # the tiny model's positions: longest prompt + response
    init_seed: int = 0             # seed of the tiny model's random initial weights
    dtype: str = "float32"         # float32 | bfloat16 | float16 (float16 on cuda only)


@dataclass
class WorkloadConfig:
    """The task and the shape of its batches (dynaresize/data/shapes.py; presets in dynaresize/conf/workload/)."""
    task: str = "reverse"          # reverse | sort | add (built-in digit tasks) | dataset (data.*)
    digits_min: int = 3            # fewest digits of a built-in task's question
    digits_max: int = 8            # most digits of a built-in task's question
    # Instruction context before the question, in tokens: log-normal (median 0: none), at most prompt_max.
    prompt_median: float = 0.0
    prompt_sigma: float = 0.0      # log-normal spread of the instruction context's length
    prompt_max: int = 0            # longest instruction context in tokens
    # Hidden response lengths: a log-normal scale per prompt around a median that drifts by
    # `length_growth` per batch, a log-normal spread per sample, cut to [length_min, length_max].
    length_median: float = 16.0
    length_sigma: float = 0.8      # log-normal spread of the per-prompt scale (the long tail)
    sample_sigma: float = 0.0      # spread of the samples of one prompt group around its scale
    length_growth: float = 0.05    # median *= (1 + growth) each batch
    length_period: int = 0         # batches of one cycle of the median (0: none): a curriculum that cycles
    length_amplitude: float = 0.0  # the cycle's swing: median *= exp(amplitude x sin(2 pi batch / period))
    length_min: int = 4            # the shortest response
    length_max: int = 96           # the max response length (cap)
    length_max_schedule: list[Any] = field(default_factory=list)  # [[batch, cap], ...]: cap from that batch on
    signal_share: list[Any] = field(default_factory=list)         # [[batch, share], ...]: simulated groups whose rewards differ (DAPO)
    mixture: list[Any] = field(default_factory=list)              # task presets ({length_median: ..}), rotating every mixture_block
    mixture_block: int = 10        # iterations a mixture's task lasts before the next one


@dataclass
class DataConfig:
    """Prompts from your own dataset (workload.task=dataset, preset workload=dataset; dynaresize/data/datasets.py)."""
    train_files: list[str] = field(default_factory=list)  # JSONL (one object per line) or Parquet files
    val_files: list[str] = field(default_factory=list)    # held-out prompts for eval.* (the same formats and checks)
    prompt_key: str = "prompt"     # the field holding the prompt text
    answer_key: str = "answer"     # the field holding the reference answer (handed to the reward)
    apply_chat_template: bool = True   # wrap the prompt as a user message with the tokenizer's chat template
    max_prompt_length: Optional[int] = None  # tokens; None: no limit besides the model's positions
    truncation: str = "error"      # a prompt over max_prompt_length: error | left (keep its end) | right (keep its start)
    shuffle: bool = True           # a new permutation per epoch, keyed by run.seed and the epoch
    skip_bad_rows: bool = False    # drop rows whose prompt is not text or empty, or whose answer is missing or NaN (else: refused)


@dataclass
class RewardConfig:
    """The reward: `fn(prompt, response, answer, extra) -> float` (dynaresize/data/rewards.py)."""
    _target_: str = "dynaresize.data.rewards.digit_match"   # dotted path of a function importable on every rank
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments (+reward.kwargs.NAME=VALUE)
    on_error: str = "fail"         # a reward that raises: fail (end the job naming the sample) | zero (score 0, warn)
    timeout_s: float = 60.0        # a reward call that takes longer fails as one that raised (on_error); 0: no limit


@dataclass
class RolloutConfig:
    engine: str = "torch"          # torch | vllm
    prompts_per_batch: int = 8     # prompt groups trained per iteration
    samples_per_prompt: int = 4    # GRPO group size
    temperature: float = 1.0       # sampling temperature (the trainer's log-probabilities use it too)
    ignore_eos: bool = False       # benchmarking: every response runs to its hidden length (no early <eos>)
    # tail migration: a rollout rank with this many sequences left or fewer hands them to a tail rank
    migration_threshold: Any = 0   # 0: off; auto: the cost model's choice of it and tail_ranks
    tail_ranks: int = 1            # the first rollout ranks at their cut finish the others' sequences
    # tail speculation (torch engine): decode with draft tokens from the group's sibling responses,
    # verified in one forward pass: off | tail (once a group has speculation_below running rows
    # or fewer) | always. Every token is still a draw from the model's distribution (greedy: the
    # same tokens), but a seed draws another sample than without it.
    speculation: str = "off"
    speculation_tokens: int = 4    # draft tokens verified per step at most
    speculation_below: int = 2     # tail: running sequences of a group (priced: of a vLLM rank) from which it speculates
    # tokens a sequence gains per verify step, as the cost model prices speculation (Seer, arXiv
    # 2511.14617, Fig. 11: 1.77-2.15 measured); a run reports its own (tokens_per_verify)
    speculation_acceptance: float = 2.0
    # vLLM engine settings (rollout=vllm)
    gpu_memory_utilization: float = 0.5  # share of the GPU's memory vLLM may take (weights + KV cache)
    release: str = "sleep"         # on leaving rollout: sleep (CUDA sleep mode) | teardown | keep
    sleep_level: int = 1           # vLLM sleep level: 1 offloads the weights to host memory, 2 discards them
    engine_args: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM arguments


@dataclass
class TrainerConfig:
    lr: float = 1e-3               # AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    eps: float = 1e-8              # AdamW epsilon
    weight_decay: float = 0.0      # AdamW decoupled weight decay
    clip_ratio: float = 0.2        # PPO clip range of the importance ratio (GRPO)
    kl_coef: float = 0.0           # weight of the KL penalty to the initial (reference) policy; 0: no reference model
    grad_clip: float = 1.0         # clip the global gradient norm to this; 0: off
    micro_batch_size: int = 4      # samples per micro-batch (gradient accumulation absorbs the split)
    # Gradients are summed across micro-batches and ranks in float64, so the sum (and thus the
    # weights) does not depend on how many train ranks there are, up to the final rounding.
    grad_reduce_dtype: str = "float64"
    # What a train rank holds (plan/memory.py): optimizer (ZeRO-1, trainer.py: every train rank
    # holds the whole model, AdamW state sharded; split-invariant to the last bit) | full (FSDP2,
    # fsdp.py: parameters, gradients and AdamW state sharded; a resize reshards through DCP)
    sharding: str = "optimizer"
    weight_sync_bucket_mb: int = 256   # sharding=full: weights gathered and sent to the engines this many MiB at a time
    activation_checkpointing: bool = False   # keep each decoder layer's input only; recompute the rest in backward
    logit_chunk_tokens: int = 0    # compute the output head's logits this many tokens at a time; 0: all at once
    # Recompute the old (behaviour) log-probabilities with the trainer's weights before the update,
    # as verl's old_log_prob pass does, instead of taking the rollout engine's.
    recompute_logprobs: bool = False
    # Work stealing (stealing.py): a rollout rank that has generated its share computes gradients of
    # micro-batches the train ranks have not taken yet; it keeps a float32 copy of the weights.
    work_stealing: bool = False
    # DAPO's dynamic sampling: train only prompt groups whose rewards differ; rollout generates
    # rounds of rollout.prompts_per_batch groups until that many differ (or filter_max_rounds)
    filter_groups: bool = False
    filter_max_rounds: int = 4     # rounds at most; then the batch trains with the groups it has (a warning)


@dataclass
class PolicyConfig:
    name: str = "static"           # static | colocated | dynamic | scripted
    # initial (or fixed) number of train ranks; dynamic also takes "auto": the cost model's choice
    train_ranks: Any = 2
    resize_unit: int = 1           # ranks moved together (a node, a TP group)
    # dynamic (see policy.DynamicPolicy)
    horizon: int = 8               # iterations a plan looks ahead (a move must pay back within them)
    dead_band: float = 0.01        # a plan must save more than this share of the horizon's time to move
    smoothing: float = 0.5         # EMA weight of the newest measurement (stage and switch corrections)
    pricing_workers: int = 0       # processes pricing a decision's candidate rollouts (0: the deciding rank alone)
    # scripted: train ranks of iteration 0, 1, 2, ... (the last entry holds afterwards)
    schedule: list[int] = field(default_factory=list)


@dataclass
class StagingConfig:
    buffer_mb: int = 4             # chunk size of staged HDF5 datasets
    critical: bool = False         # stage-out/in on the critical path (benchmark baseline)
    reuse_groups: bool = True      # False: create groups at switch time (benchmark baseline)
    transport: str = "auto"        # file (node-local HDF5) | network (data plane) | auto: file on one node
    fsync: bool = False            # fsync staged files (durability is not needed for a live switch)


@dataclass
class RunConfig:
    iterations: int = 8            # RL iterations (batches generated and trained)
    max_lag: int = 1               # 0: synchronous; 1: rollout of batch i+1 overlaps training on i
    seed: int = 1234               # every random draw is a function of it (sampling, prompts, shapes)
    mode: str = "real"             # real | emulate (| simulate, set by dynaresize-sim)
    output_dir: Optional[str] = None   # set by the launcher (the Hydra run directory)
    checkpoint_every: int = 10     # iterations between checkpoints (and one after the last); 0: only on Slurm's warning
    resume: Optional[str] = None   # a run directory to continue: its config.yaml, your overrides on top
    save_model: bool = True        # write final_model/ (Hugging Face format) at the end
    report: bool = True            # write the analysis report (dynaresize-analyze) when the run ends
    stall_timeout_s: Optional[float] = None   # a rank silent this long ends the job; None: 10 x the longest operation so far, at least 600 s


@dataclass
class SimOptions:
    """dynaresize-sim's options (`sim.*`); the runtime ignores them."""
    noise: float = 0.0             # relative std of multiplicative noise on every simulated duration
    prompts_per_rank: int = 0      # > 0: rollout.prompts_per_batch = prompts_per_rank x cluster.ranks
    units: int = 0                 # > 0: policy.resize_unit = cluster.ranks / units
    train_units: int = 0           # > 0: policy.train_ranks = train_units x policy.resize_unit
    samples: str = "auto"          # one timeline row per sample: yes | no | auto (runs of up to 5M
                                   # samples); without them the analysis counts tokens from rollout events
    flush_every: int = 64          # iterations buffered between timeline writes
    progress: bool = False         # print one line per iteration
    charge_decisions: bool = False  # add each decision's wall time here to the simulated time (a real
                                   # run's ranks wait for rank 0's decision); the timeline is then not deterministic


@dataclass
class LogConfig:
    """What rank 0 writes besides the per-iteration metrics (whose backends `logger` chooses)."""
    generations_every: int = 5     # iterations between samples of generated text (0: never)
    generations: int = 4           # (prompt, response, reward) rows each time: generations.jsonl, TensorBoard, wandb


@dataclass
class EvalConfig:
    """Held-out evaluation: the rollout ranks generate for held-out prompts with the current weights
    (data.val_files, or the built-in task's held-out prompts) and rank 0 logs eval/*."""
    every: int = 0                 # iterations between evaluations, from iteration 0, and after the last; 0: none
    prompts: int = 32              # held-out prompts (the first rows of data.val_files; 0: all of them)
    samples_per_prompt: int = 4    # k of pass@k
    temperature: float = 1.0       # 0: greedy (one sample per prompt is then enough)
    pass_reward: float = 1.0       # a sample passes with at least this reward (pass@k)


@dataclass
class JobConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    staging: StagingConfig = field(default_factory=StagingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # Hardware profile for run.mode=emulate and the simulator (dynaresize/conf/hardware/, +hardware=h100);
    # unset: the CPU profile fitted on this setting.
    hardware: Optional[dict[str, Any]] = None
    # Where rank 0 writes per-iteration metrics: console (the progress line), tensorboard, wandb.
    logger: list[str] = field(default_factory=lambda: ["console"])
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sim: SimOptions = field(default_factory=SimOptions)

    @property
    def batch_size(self) -> int:
        return self.rollout.prompts_per_batch * self.rollout.samples_per_prompt


def register_schema() -> None:
    """The typed schema as `dynaresize_schema`, the base of dynaresize/conf/config.yaml, for both command lines
    (dynaresize, dynaresize-sim): every field exists, with its type and default."""
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name="dynaresize_schema", node=JobConfig)


def parse_config(raw: DictConfig | dict) -> JobConfig:
    """Merge a composed config onto the typed schema; unknown keys and wrong types are errors.
    The values are not checked here: `dynaresize.launch.validate.load_config` does both."""
    if isinstance(raw, dict):
        raw = OmegaConf.create(raw)
    raw = OmegaConf.masked_copy(raw, [k for k in raw if k != "hydra"]) if "hydra" in raw else raw
    unknown = unknown_fields(OmegaConf.to_container(raw, resolve=False), JobConfig)
    if unknown:
        raise ConfigError("invalid configuration:\n" + "\n".join(unknown_field_problem(name) for name in unknown))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(JobConfig), raw)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError("invalid configuration:\n" + omegaconf_problem(e)) from None
    return cfg


def schema_field(key: str) -> tuple[str, Any, Any]:
    """What the schema says about dotted `key` (`trainer.lr`, `trainer.betas[0]`): (kind, type,
    default) with kind "field" (a typed field), "mapping" (a key inside a free-form dict field such
    as cluster.sbatch_extra, or hardware), "hydra" (Hydra's own settings) or "unknown"."""
    parts = [p for p in re.sub(r"\[\d+\]", "", key).split(".") if p]
    if parts[:1] == ["hydra"]:
        return "hydra", None, None
    node_type, node = JobConfig, JobConfig()
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(node_type) if dataclasses.is_dataclass(node_type) else {}
        if part not in hints:
            return "unknown", None, None
        tp, node = hints[part], getattr(node, part)
        if dataclasses.is_dataclass(tp):
            node_type = tp
            continue
        if i < len(parts) - 1:          # below a non-dataclass field: a dict's own keys
            free = tp is dict or typing.get_origin(tp) is dict or dict in typing.get_args(tp) or any(
                typing.get_origin(a) is dict for a in typing.get_args(tp))
            return ("mapping" if free else "unknown"), None, None
        return "field", tp, node
    return "field", node_type, node


def type_name(tp: Any) -> str:
    """`float`, `list[int]`, `str or null` ... as a user writes them."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in args) + (" or null" if len(args) < len(typing.get_args(tp)) else "")
    if typing.get_origin(tp) is None and isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def unknown_field_problem(key: str) -> str:
    """The line of an invalid configuration that reports unknown key `key`, with the likely fix."""
    kind, _, _ = schema_field(key)
    if kind == "mapping":
        return (f"  {key}: not a key of the mapping yet. Fix: add it with +{key}=VALUE "
                f"(new keys of a free-form mapping need the + prefix).")
    if kind == "hydra":
        return (f"  {key}: unknown Hydra setting. Fix: check the spelling against `dynaresize --cfg hydra` "
                f"(or drop the override).")
    parent, _, leaf = key.rpartition(".")
    kind, tp, _ = schema_field(parent) if parent else ("field", JobConfig, None)
    names = [f.name for f in dataclasses.fields(tp)] if kind == "field" and dataclasses.is_dataclass(tp) else []
    close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)
    if close:
        return (f"  {key}: unknown field. Fix: write {parent + '.' if parent else ''}{close[0]} (the closest "
                f"field; every field is in dynaresize/config.py).")
    return (f"  {key}: unknown field. Fix: check the spelling against dynaresize/config.py "
            f"(or drop the override).")


def omegaconf_problem(e: OmegaConfBaseException, key: Optional[str] = None) -> str:
    """The line of an invalid configuration for OmegaConf's error `e` (a wrong type, a key the
    schema does not have), naming the field and the fix."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key = getattr(e, "full_key", None) or key or "?"
    if isinstance(e, (ConfigAttributeError, ConfigKeyError)) and "not in" in str(getattr(e, "msg", e)):
        return unknown_field_problem(key)
    problem = str(getattr(e, "msg", None) or e).strip().splitlines()[0].rstrip(".")
    kind, tp, default = schema_field(key)
    if kind == "field" and not dataclasses.is_dataclass(tp):
        fix = f"give a value of type {type_name(tp)} (the default is {default!r})"
    elif kind == "field":
        fix = f"set the fields of {key} (key.field=value), or choose a preset of its config group"
    else:
        fix = "correct the value (see dynaresize/conf/ and dynaresize/config.py for the fields and their types)"
    return f"  {key}: {problem}. Fix: {fix}."


def unknown_fields(raw: dict, schema, prefix: str = "") -> list[str]:
    """Keys of `raw` that the dataclass `schema` does not have (dict-typed fields take any key)."""
    types = typing.get_type_hints(schema)
    out = []
    for key, value in raw.items():
        if key not in types:
            out.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(types[key]) and isinstance(value, dict):
            out += unknown_fields(value, types[key], f"{prefix}{key}.")
    return out


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
