"""The value checks of a job configuration: what types cannot express (ranges, names, files, how
fields fit together). `load_config` runs them after the typed merge (`config.parse_config`), in the
launching process, before any rank starts; one ConfigError lists every problem, each with its
field and the fix.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os

from omegaconf import DictConfig

from ..config import ConfigError, JobConfig, parse_config
from ..plan.memory import SHARDINGS, describe, job_train_side, min_train_ranks, remedies, train_bytes
from ..plan.policy import POLICIES
from ..runtime.rollout.base import ENGINES, SPECULATION
from ..data.shapes import longest_sequence, prompt_extra_tokens


def load_config(raw: DictConfig | dict) -> JobConfig:
    """A composed config as the typed, validated JobConfig, or one ConfigError naming every problem."""
    cfg = parse_config(raw)
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Check values that types cannot; raise one ConfigError listing every problem."""
    errors: list[str] = []

    def need(ok: bool, fld: str, problem: str, fix: str) -> None:
        if not ok:
            errors.append(f"  {fld}: {problem}. Fix: {fix}.")

    c, m, w, r, t, p, s, run = (cfg.cluster, cfg.model, cfg.workload, cfg.rollout, cfg.trainer,
                                cfg.policy, cfg.staging, cfg.run)
    need(c.launcher in ("local", "srun", "slurm"), "cluster.launcher", f"unknown launcher {c.launcher!r}",
         "use local, srun or slurm (cluster=local / cluster=slurm)")
    need(c.device in ("cpu", "cuda"), "cluster.device", f"unknown device {c.device!r}", "use cpu or cuda")
    if c.launcher == "slurm":
        need(c.nodes >= 1, "cluster.nodes", f"is {c.nodes}", "request at least 1 node")
        need(c.gpus_per_node >= 1, "cluster.gpus_per_node", f"is {c.gpus_per_node}",
             "request at least 1 GPU (one rank) per node")
        need(c.ranks == c.nodes * c.gpus_per_node, "cluster.ranks",
             f"is {c.ranks} but nodes x gpus_per_node is {c.nodes * c.gpus_per_node}",
             "leave cluster.ranks to the slurm preset (it is nodes * gpus_per_node)")
        need(c.time_min >= 1, "cluster.time_min", f"is {c.time_min}", "give the job at least 1 minute")
        need(c.max_requeues >= 0, "cluster.max_requeues", f"is {c.max_requeues}",
             "use 0 (never requeue after Slurm's warning: checkpoint and stop) or more")
    need(c.ranks >= 2, "cluster.ranks", f"is {c.ranks}; rollout and training need at least one rank each",
         "use cluster.ranks=2 or more")
    if c.local_scratch is not None:
        scratch = os.path.expandvars(c.local_scratch)
        if os.path.exists(scratch) and not os.path.isdir(scratch):
            need(False, "cluster.local_scratch", f"{c.local_scratch!r} is a file, not a directory",
                 "give a directory (staging writes a folder per job inside it), or leave it unset")
        else:
            need(os.path.isdir(scratch), "cluster.local_scratch",
                 f"directory {c.local_scratch!r} does not exist", "create it or leave it unset")
    # The device must exist where the ranks run: here for launcher=local; for srun and slurm the
    # GPUs are on the compute nodes, which this process cannot see. The simulator uses none.
    if c.device == "cuda" and c.launcher == "local" and run.mode != "simulate":
        need(cuda_available(), "cluster.device",
             "is cuda but torch sees no GPU on this machine (torch.cuda.is_available() is false) and "
             "launcher=local runs the ranks here", "use cluster.device=cpu, or run where a GPU is visible")

    try:
        longest = longest_sequence(w)
    except (TypeError, ValueError):      # a malformed length_max_schedule, reported below
        longest = 0
    if w.task == "dataset":
        longest = 0                      # dataset prompts are measured by data.check_dataset
    if m.path is not None:
        config_json = os.path.join(m.path, "config.json")
        need(os.path.isfile(config_json), "model.path",
             f"{m.path!r} is not a Hugging Face checkpoint directory (no config.json)",
             "point it at a directory written by save_pretrained, or unset it for the tiny model")
        if os.path.isfile(config_json) and run.mode != "simulate":
            try:
                with open(config_json) as f:
                    hf = json.load(f)
                positions = hf.get("max_position_embeddings", hf.get("n_positions")) if isinstance(hf, dict) else None
            except (OSError, ValueError) as e:
                positions = None
                need(False, "model.path", f"{config_json} cannot be read as JSON ({e})",
                     "point model.path at an intact checkpoint written by save_pretrained")
            if isinstance(positions, int) and not isinstance(positions, bool):
                need(longest <= positions, "model.path",
                     f"the checkpoint's max_position_embeddings ({positions}, in {config_json}) is shorter than "
                     f"the longest prompt plus response ({longest}: workload.prompt_max + digits_max + "
                     f"{prompt_extra_tokens(w.task)} + the largest length_max); generation would run past "
                     f"the model's positions", "lower workload.length_max (and its schedule) or "
                     "workload.prompt_max, or use a model with more positions")
    else:
        need(m.hidden_size > 0 and m.num_heads > 0 and m.hidden_size % m.num_heads == 0, "model.hidden_size",
             f"{m.hidden_size} is not divisible by model.num_heads={m.num_heads}", "choose a multiple of num_heads")
        if m.num_heads > 0 and m.hidden_size % m.num_heads == 0:
            need(m.hidden_size // m.num_heads >= 32, "model.num_heads",
                 f"head size {m.hidden_size // m.num_heads} is below 32 (vLLM's CPU backend refuses it)",
                 "use fewer heads or a larger hidden_size (e.g. 128 and 4)")
        need(m.num_kv_heads > 0 and m.num_heads % max(m.num_kv_heads, 1) == 0, "model.num_kv_heads",
             f"{m.num_kv_heads} does not divide num_heads={m.num_heads}", "use a divisor of num_heads")
        need(m.num_layers >= 1, "model.num_layers", f"is {m.num_layers}", "use 1 or more")
        if run.mode != "simulate":        # the simulator prices hardware.model, not this one
            need(longest <= m.max_position, "model.max_position",
                 f"{m.max_position} is shorter than the longest prompt plus response ({longest})",
                 "raise model.max_position or lower workload.length_max (and its schedule)")
    need(m.dtype in ("float32", "bfloat16", "float16"), "model.dtype", f"unknown dtype {m.dtype!r}",
         "use float32, bfloat16 or float16")
    if run.mode != "simulate":            # the simulator only prices the dtype's bytes
        need(not (m.dtype == "float16" and c.device == "cpu"), "model.dtype",
             "float16 on cluster.device=cpu: torch's CPU kernels for half precision are missing or "
             "slow", "use model.dtype=bfloat16 or float32 on CPU (float16 needs cluster.device=cuda)")

    need(w.task in ("reverse", "sort", "add", "dataset"), "workload.task", f"unknown task {w.task!r}",
         "use reverse, sort or add (built-in), or dataset (workload=dataset with data.train_files)")
    if w.task == "dataset":
        validate_data(cfg, need)
    need(isinstance(cfg.reward._target_, str) and "." in cfg.reward._target_, "reward._target_",
         f"is {cfg.reward._target_!r}", "give the dotted path of a function, e.g. dynaresize.data.rewards.gsm8k")
    need(cfg.reward.on_error in ("fail", "zero"), "reward.on_error", f"unknown {cfg.reward.on_error!r}",
         "use fail (end the job naming the sample) or zero (score the sample 0 and warn)")
    from ..runtime.metrics_logger import check_backends
    errors.extend(f"  {line}" for line in check_backends(list(cfg.logger)))
    need(1 <= w.digits_min <= w.digits_max, "workload.digits_min",
         f"digits_min={w.digits_min}, digits_max={w.digits_max}", "need 1 <= digits_min <= digits_max")
    need(1 <= w.length_min <= w.length_max, "workload.length_min",
         f"length_min={w.length_min}, length_max={w.length_max}", "need 1 <= length_min <= length_max")
    need(w.length_median > 0 and w.length_sigma >= 0 and w.sample_sigma >= 0, "workload.length_median",
         "median must be > 0, length_sigma and sample_sigma >= 0", "set a positive median and non-negative sigmas")
    need(w.prompt_median >= 0 and w.prompt_sigma >= 0 and w.prompt_max >= 0, "workload.prompt_median",
         "prompt_median, prompt_sigma and prompt_max must be >= 0", "fix the prompt-length settings")
    need(w.prompt_median == 0 or w.prompt_max >= 1, "workload.prompt_max",
         f"is {w.prompt_max} with prompt_median={w.prompt_median}", "give the longest context (prompt_max >= 1)")
    for name, points, low, high, example in (
            ("length_max_schedule", w.length_max_schedule, w.length_min, math.inf, "[[0, 8192], [40, 16384]]"),
            ("signal_share", w.signal_share, 1e-9, 1.0, "[[0, 0.6], [99, 0.3]]")):
        ok = all(isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, (int, float)) for x in p)
                 and p[0] >= 0 and low <= p[1] <= high for p in points)
        ok = ok and all(a[0] < b[0] for a, b in zip(points, points[1:]))
        bounds = f">= {low}" if high == math.inf else "in (0, 1]"
        need(ok, f"workload.{name}", f"{points} is not a list of [batch, value] pairs with increasing batches "
             f"and values {bounds}", f"write e.g. {example}")
    need(t.filter_max_rounds >= 1, "trainer.filter_max_rounds", f"is {t.filter_max_rounds}", "use 1 or more")
    need(not (t.filter_groups and r.migration_threshold != 0), "trainer.filter_groups",
         "and rollout.migration_threshold are both set; a tail migration cannot cross a round of dynamic "
         "sampling", "use one of them (rollout.migration_threshold=0 with filter_groups)")
    keys = {"length_median", "length_sigma", "prompt_median", "prompt_sigma"}
    for i, entry in enumerate(w.mixture):
        ok = (isinstance(entry, dict) and set(entry) <= keys
              and all(isinstance(v, (int, float)) and v >= 0 for v in entry.values())
              and entry.get("length_median", 1) > 0)
        need(ok, f"workload.mixture[{i}]", f"{entry} is not a mapping of known keys to non-negative numbers",
             f"use only {sorted(keys)}, e.g. {{length_median: 3000, prompt_median: 200}}")
        need(not ok or entry.get("prompt_median", 0) == 0 or w.prompt_max >= 1, f"workload.mixture[{i}]",
             "sets prompt_median but workload.prompt_max is 0", "give workload.prompt_max")
    need(w.mixture_block >= 1, "workload.mixture_block", f"is {w.mixture_block}", "use 1 or more batches per task")
    need(w.length_period >= 0, "workload.length_period", f"is {w.length_period}",
         "use 0 (no cycle) or the batches of one cycle of the median response length")
    need(math.isfinite(w.length_amplitude) and w.length_amplitude >= 0, "workload.length_amplitude",
         f"is {w.length_amplitude}", "use 0 or more (the median swings by exp(+-amplitude))")
    # shapes.batch_shape: median = length_median * (1 + growth) ** batch, whose log is drawn from;
    # -1 < growth < 0 shrinks responses each batch, -1 or less would make the median 0 or negative.
    need(math.isfinite(w.length_growth) and w.length_growth > -1, "workload.length_growth",
         f"is {w.length_growth}; the median response length is multiplied by (1 + length_growth) each "
         f"batch, so it must stay above -1", "use e.g. 0.05 (grow 5 % a batch), 0 (stationary) or -0.02 "
         "(shrink 2 % a batch)")

    engine = ENGINES.get(r.engine)
    need(engine is not None, "rollout.engine", f"unknown engine {r.engine!r}", f"use one of {', '.join(ENGINES)}")
    if engine is not None and engine.requires:
        need(importlib.util.find_spec(engine.requires) is not None, "rollout.engine",
             f"{engine.requires} is not installed", f"{engine.install}, or use rollout=torch")
    if engine is not None and engine.manages_gpu_memory:
        need(r.sleep_level in (1, 2), "rollout.sleep_level", f"is {r.sleep_level}", "use 1 (offload weights) or 2 (discard)")
        need(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", f"is {r.gpu_memory_utilization}",
             "use a fraction in (0, 1]")
    need(r.prompts_per_batch >= 1, "rollout.prompts_per_batch", f"is {r.prompts_per_batch}", "use 1 or more")
    need(r.samples_per_prompt >= 2, "rollout.samples_per_prompt",
         f"is {r.samples_per_prompt}; GRPO normalises rewards within a group", "use 2 or more")
    need(r.temperature >= 0, "rollout.temperature", f"is {r.temperature}", "use 0 (greedy) or more")
    need(r.release in ("sleep", "teardown", "keep"), "rollout.release", f"unknown {r.release!r}",
         "use sleep, teardown or keep")
    migrates = r.migration_threshold == "auto" or (isinstance(r.migration_threshold, int)
                                                   and r.migration_threshold > 0)
    need(migrates or r.migration_threshold == 0, "rollout.migration_threshold",
         f"is {r.migration_threshold!r}", "use 0 (no tail migration), a number of sequences, e.g. 2, "
         "or auto (chosen from the cost model)")
    need(isinstance(r.tail_ranks, int) and r.tail_ranks >= 1, "rollout.tail_ranks", f"is {r.tail_ranks!r}",
         "use 1 or more")
    need(r.speculation in SPECULATION, "rollout.speculation", f"unknown {r.speculation!r}",
         f"use {', '.join(SPECULATION)}")
    if r.speculation != "off":
        need(isinstance(r.speculation_tokens, int) and r.speculation_tokens >= 1, "rollout.speculation_tokens",
             f"is {r.speculation_tokens!r}", "use 1 or more draft tokens a step, e.g. 4")
        need(isinstance(r.speculation_below, int) and r.speculation_below >= 1, "rollout.speculation_below",
             f"is {r.speculation_below!r}", "use 1 or more running rows, e.g. 2")
        need(isinstance(r.speculation_acceptance, (int, float))
             and 1 <= r.speculation_acceptance <= 1 + max(r.speculation_tokens, 0), "rollout.speculation_acceptance",
             f"is {r.speculation_acceptance!r}; a verify step keeps 1 to 1 + speculation_tokens tokens",
             "use a value in that range, e.g. 2.0")
        need(r.engine == "torch" or run.mode == "simulate", "rollout.speculation",
             f"is {r.speculation} with rollout.engine={r.engine}: sibling drafts are the torch engine's",
             "for vLLM pass its own speculative_config in rollout.engine_args (method ngram or suffix), "
             "or use rollout.speculation=off")
        need(run.mode == "real" or not migrates, "rollout.speculation",
             f"is {r.speculation} with tail migration and run.mode={run.mode}: the cost model prices "
             "either, not both together", "use one of them, or run.mode=real")
    if migrates:
        need(run.mode != "emulate", "rollout.migration_threshold",
             f"is {r.migration_threshold} with run.mode=emulate: an emulated stage lasts its price, but the "
             "torch engine's hand-off is not priced (the simulator prices vLLM's)",
             "use run.mode=real or dynaresize-sim, or rollout.migration_threshold=0")

    need(math.isfinite(t.lr) and t.lr > 0, "trainer.lr", f"is {t.lr}", "use a positive, finite learning rate, e.g. 1e-6")
    # the checks of the batch's micro-batches only once the batch itself is valid (one problem, one line)
    batch_ok = r.prompts_per_batch >= 1 and r.samples_per_prompt >= 2
    need(not batch_ok or (t.micro_batch_size >= 1 and cfg.batch_size % max(t.micro_batch_size, 1) == 0),
         "trainer.micro_batch_size",
         f"{t.micro_batch_size} does not divide the batch of {cfg.batch_size} samples "
         f"(rollout.prompts_per_batch x rollout.samples_per_prompt)", "choose a divisor of the batch size")
    need(t.grad_reduce_dtype in ("float32", "float64"), "trainer.grad_reduce_dtype",
         f"unknown {t.grad_reduce_dtype!r}", "use float64 (split-invariant) or float32")
    need(0 < t.clip_ratio < 1, "trainer.clip_ratio", f"is {t.clip_ratio}", "use a value in (0, 1), e.g. 0.2")
    # torch.optim.AdamW (trainer.py) refuses these only once the ranks have started.
    betas = list(t.betas) if isinstance(t.betas, (list, tuple)) else [t.betas]
    need(len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas), "trainer.betas",
         f"is {betas}; AdamW takes two decay rates in [0, 1)", "give two values, e.g. [0.9,0.999]")
    need(math.isfinite(t.eps) and t.eps > 0, "trainer.eps", f"is {t.eps}", "use a small positive value, e.g. 1e-8")
    need(math.isfinite(t.weight_decay) and t.weight_decay >= 0, "trainer.weight_decay", f"is {t.weight_decay}",
         "use 0 (none) or a positive value, e.g. 0.01")
    need(t.grad_clip >= 0, "trainer.grad_clip", f"is {t.grad_clip}; it is the largest gradient norm kept",
         "use a positive norm, e.g. 1.0, or 0 to turn clipping off")
    need(t.sharding in SHARDINGS, "trainer.sharding", f"unknown {t.sharding!r}", f"use one of {', '.join(SHARDINGS)}")
    if t.sharding == "full" and run.mode != "simulate":    # what the runtime's FSDP2 trainer does not do yet
        need(not t.work_stealing, "trainer.work_stealing", "is true with trainer.sharding=full: a helper's "
             "gradient sums are sent as ranges of the ZeRO-1 flat vector", "use trainer.sharding=optimizer, or "
             "drop trainer.work_stealing")
    need(t.logit_chunk_tokens >= 0, "trainer.logit_chunk_tokens", f"is {t.logit_chunk_tokens}",
         "use 0 (all logits at once) or a number of tokens, e.g. 2048")

    kind = POLICIES.get(p.name)
    runnable = [k.name for k in POLICIES.values() if not k.simulator_only]
    only_sim = [k.name for k in POLICIES.values() if k.simulator_only]
    need(kind is not None and (run.mode == "simulate" or not kind.simulator_only), "policy.name",
         f"unknown policy {p.name!r}" if kind is None else f"{p.name} is a simulator-only policy",
         f"use policy={', '.join(runnable)} (policy.name={', '.join(only_sim)} only in dynaresize-sim)")
    need(p.resize_unit >= 1 and c.ranks % max(p.resize_unit, 1) == 0, "policy.resize_unit",
         f"{p.resize_unit} does not divide cluster.ranks={c.ranks}", "use a divisor of the rank count")
    chooses = kind is not None and kind.chooses_start     # picks its own start (or uses every rank)
    colocated = kind is not None and kind.colocated
    scripted = kind is not None and kind.scripted
    need(isinstance(p.train_ranks, int) or (p.train_ranks == "auto" and chooses), "policy.train_ranks",
         f"is {p.train_ranks!r}", "give a number of train ranks" + (" or auto" if chooses else ""))
    if not colocated and c.ranks >= 2 and isinstance(p.train_ranks, int):
        need(1 <= p.train_ranks <= c.ranks - 1, "policy.train_ranks",
             f"is {p.train_ranks}, outside 1..{c.ranks - 1} (cluster.ranks - 1)",
             f"choose 1 to {c.ranks - 1}, leaving at least one rollout rank")
        need(p.train_ranks % max(p.resize_unit, 1) == 0, "policy.train_ranks",
             f"{p.train_ranks} is not a multiple of policy.resize_unit={p.resize_unit}", "use a multiple")
    micro_batches = cfg.batch_size // max(t.micro_batch_size, 1)
    most_train = c.ranks if colocated else c.ranks - p.resize_unit
    need(not batch_ok or micro_batches >= most_train, "trainer.micro_batch_size",
         f"the batch has {micro_batches} micro-batches but up to {most_train} ranks may train",
         "lower trainer.micro_batch_size or raise rollout.prompts_per_batch")
    need(not (colocated and t.sharding == "full" and run.mode != "simulate"), "trainer.sharding",
         f"is full with policy={p.name}: the colocated engines take their weights from a ZeRO-1 trainer's "
         "full copy", "use trainer.sharding=optimizer with policy=colocated")
    need(not (colocated and t.work_stealing), "trainer.work_stealing",
         f"is true with policy={p.name}: every rank trains already", "drop trainer.work_stealing")
    need(not (colocated and r.migration_threshold != 0), "rollout.migration_threshold",
         f"is {r.migration_threshold} with policy={p.name}: every rank waits for the whole rollout before it "
         "trains, so a rank freed early has nothing to do", "use rollout.migration_threshold=0")
    if colocated:
        need(run.max_lag == 0, "run.max_lag", "colocated ranks do rollout and training in turn, nothing overlaps",
             "use run.max_lag=0 with policy=colocated")
    for it, k in enumerate(p.schedule):
        need(1 <= k <= c.ranks - 1 and k % max(p.resize_unit, 1) == 0, f"policy.schedule[{it}]",
             f"{k} train ranks is outside 1..{c.ranks - 1} or not a multiple of resize_unit",
             "list valid splits")
    if scripted:
        need(len(p.schedule) > 0, "policy.schedule", "is empty", "list the split of each iteration, e.g. [1,1,3,3]")
        # One split an iteration and one for the pipeline's drain (max_lag 1); the last entry holds
        # once the schedule ends, so a shorter schedule is fine.
        total = run.iterations + run.max_lag
        need(len(p.schedule) <= total, "policy.schedule",
             f"has {len(p.schedule)} entries but the run has only {total} steps (run.iterations and, with "
             f"run.max_lag=1, the pipeline's drain): the splits past entry {total} would never be used",
             f"list at most {total} splits, or raise run.iterations")
    else:
        need(not p.schedule, "policy.schedule",
             f"is {list(p.schedule)} but policy.name is {p.name}: only the scripted policy reads it, so it "
             f"would be ignored", "use policy=scripted, or drop policy.schedule")
    need(0 < p.smoothing <= 1, "policy.smoothing", f"is {p.smoothing}", "use a value in (0, 1]")
    need(p.dead_band >= 0, "policy.dead_band", f"is {p.dead_band}", "use a share >= 0, e.g. 0.01")
    need(p.horizon >= 1, "policy.horizon", f"is {p.horizon}", "look ahead at least 1 iteration, e.g. 8")
    need(isinstance(p.pricing_workers, int) and p.pricing_workers >= 0, "policy.pricing_workers",
         f"is {p.pricing_workers!r}", "use 0 (price in the deciding rank) or a number of processes, e.g. 7")

    need(s.transport in ("auto", "file", "network"), "staging.transport", f"unknown {s.transport!r}",
         "use auto, file or network")
    need(s.buffer_mb >= 1, "staging.buffer_mb", f"is {s.buffer_mb}", "use 1 or more (1-8 MiB chunks are fastest)")
    need(run.iterations >= 1, "run.iterations", f"is {run.iterations}", "use 1 or more")
    need(run.max_lag in (0, 1), "run.max_lag", f"is {run.max_lag}", "use 0 (synchronous) or 1 (one step off-policy)")
    need(run.mode in ("real", "emulate", "simulate"), "run.mode", f"unknown mode {run.mode!r}",
         "use real or emulate (simulate is dynaresize-sim's)")
    need(run.mode != "emulate" or cfg.hardware is not None, "hardware",
         "run.mode=emulate needs the hardware to emulate", "add +hardware=h100 (or another dynaresize/conf/hardware/ profile)")
    if cfg.hardware is not None:
        from ..plan.hardware import HardwareProfile, ProfileError
        try:
            HardwareProfile.from_dict(cfg.hardware)
        except (ProfileError, ValueError, TypeError) as e:
            errors.append(f"  hardware: {e}. Fix: correct the profile (see dynaresize/conf/hardware/h100.yaml).")
    need(run.checkpoint_every >= 0, "run.checkpoint_every", f"is {run.checkpoint_every}", "use 0 or more")
    need(run.stall_timeout_s is None or run.stall_timeout_s > 0, "run.stall_timeout_s", f"is {run.stall_timeout_s}",
         "use a number of seconds above 0, or null for the default (10 x the longest operation, at least 600 s)")
    need(run.resume is None, "run.resume", f"is {run.resume!r} in a config; it continues a run from the command "
         f"line only", "run `dynaresize run.resume=RUN_DIR [field=value ...]`, and leave it out of config files")

    o = cfg.sim
    need(o.noise >= 0, "sim.noise", f"is {o.noise}", "use 0 or a small positive relative std")
    need(o.samples in ("auto", "yes", "no"), "sim.samples", f"unknown {o.samples!r}", "use auto, yes or no")
    need(o.flush_every >= 1, "sim.flush_every", f"is {o.flush_every}", "use 1 or more")
    for name in ("prompts_per_rank", "units", "train_units"):
        need(getattr(o, name) >= 0, f"sim.{name}", f"is {getattr(o, name)}", "use 0 (off) or more")

    e, log = cfg.eval, cfg.log
    need(e.every >= 0, "eval.every", f"is {e.every}", "use 0 (no evaluation) or a number of iterations")
    need(e.prompts >= 0, "eval.prompts", f"is {e.prompts}", "use a number of held-out prompts (0: all of data.val_files)")
    need(e.samples_per_prompt >= 1, "eval.samples_per_prompt", f"is {e.samples_per_prompt}", "use 1 or more")
    need(e.temperature >= 0, "eval.temperature", f"is {e.temperature}", "use 0 (greedy) or more")
    need(not cfg.data.val_files or cfg.workload.task == "dataset", "data.val_files", "is set but workload.task is not dataset",
         "use workload=dataset, or leave data.val_files empty (the built-in tasks evaluate on their own "
         "held-out prompts)")
    need(log.generations_every >= 0, "log.generations_every", f"is {log.generations_every}", "use 0 (never) or more")
    need(log.generations >= 1, "log.generations", f"is {log.generations}", "use 1 or more")

    if not errors and cfg.hardware is not None:      # the sizes it needs are valid now
        check_train_memory(cfg, need)
    if errors:
        raise ConfigError("invalid configuration:\n" + "\n".join(errors))


def check_train_memory(cfg: JobConfig, need) -> None:
    """Refuse splits whose train ranks cannot hold their share of the model (plan/memory.py), with
    the fewest train ranks that fit, or, if none do, the settings that would help."""
    from ..plan.hardware import HardwareProfile
    profile = HardwareProfile.from_dict(cfg.hardware)
    if not profile.gpu_memory_bytes > 0:
        return
    model, settings = job_train_side(cfg, profile)
    c, p = cfg.cluster, cfg.policy
    unit = max(p.resize_unit, 1)
    kind = POLICIES[p.name]
    most = c.ranks if kind.colocated else c.ranks - unit
    fewest = min_train_ranks(profile, model, settings, most, unit)
    gb = profile.gpu_memory_bytes / 1e9
    if fewest is None:
        need(False, "trainer", f"no split fits: even {most} train ranks of {model.name} would each need "
             f"{train_bytes(profile, model, settings, most) / 1e9:.1f} GB of the {gb:.0f} GB GPU "
             f"({describe(model, settings, most, profile.train_reserved_bytes)})", "; ".join(remedies(settings)))
        return
    asked = [("cluster.ranks", c.ranks)] if kind.colocated else \
        ([("policy.train_ranks", p.train_ranks)] if isinstance(p.train_ranks, int) else []) + \
        [(f"policy.schedule[{it}]", k) for it, k in enumerate(p.schedule)]
    for fld, k in asked:
        need(k >= fewest, fld, f"{k} train ranks of {model.name} would each need "
             f"{train_bytes(profile, model, settings, k) / 1e9:.1f} GB of the {gb:.0f} GB GPU "
             f"({describe(model, settings, k, profile.train_reserved_bytes)})",
             f"use at least {fewest} train ranks (the fewest that fit), or: " + "; ".join(remedies(settings)))


# What a model folder must hold for the engines and the cost model (model.path).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def check_model_folder(path: str) -> list[str]:
    """The problems of a Hugging Face checkpoint folder for a job (each a line with its fix): its
    weights, a causal language model, the config fields the engines and the cost model read.
    Files only (no torch): the launcher checks it before any rank starts."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        return [f"model.path: {path}/config.json cannot be read ({e}). Fix: give a folder written by "
                f"save_pretrained."]
    problems = []
    if not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES):
        problems.append(f"model.path: {path} holds no weights (none of {', '.join(WEIGHT_FILES)}). Fix: give the "
                        f"folder save_pretrained wrote, weights included.")
    architectures = hf.get("architectures") or []
    if architectures and not any(str(a).endswith(CAUSAL_SUFFIXES) for a in architectures):
        problems.append(f"model.path: {path} is a {', '.join(map(str, architectures))}, not a causal language "
                        f"model. Fix: give a decoder-only checkpoint (an ...ForCausalLM, e.g. Qwen2ForCausalLM).")
    missing = [name for name in CONFIG_FIELDS if not isinstance(hf.get(name), int)]
    if missing:
        problems.append(f"model.path: {path}/config.json lacks {', '.join(missing)}, which the rollout engines and "
                        f"the cost model read. Fix: use a checkpoint of a supported architecture (Qwen2, Llama, "
                        f"Mistral, ...).")
    return problems


def validate_data(cfg: JobConfig, need) -> None:
    """workload.task=dataset: the files and settings (data.check_dataset reads the rows later)."""
    d, run = cfg.data, cfg.run
    need(run.mode != "simulate", "workload.task", "is dataset, but the simulator prices synthetic batch "
         "shapes", "simulate one of the dynaresize/conf/workload/ presets that resembles your data")
    need(bool(d.train_files), "data.train_files", "is empty but workload.task is dataset",
         "list your JSONL or Parquet files, e.g. data.train_files=[data/train.jsonl]")
    for field, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for i, path in enumerate(files):
            need(str(path).endswith((".jsonl", ".json", ".parquet")), f"{field}[{i}]",
                 f"{path!r} is neither .jsonl, .json nor .parquet", "convert it to JSONL (one object per line)")
            need(os.path.isfile(path), f"{field}[{i}]", f"{path!r} does not exist",
                 "give the path of an existing file (relative paths start where dynaresize is run)")
    need(cfg.eval.every == 0 or bool(d.val_files), "data.val_files", "is empty but eval.every asks for a "
         "held-out evaluation of your dataset", "list held-out JSONL or Parquet files, e.g. "
         "data.val_files=[data/test.jsonl], or set eval.every=0")
    need(cfg.model.path is not None, "model.path", "is unset but workload.task is dataset: the built-in "
         "tiny model's character vocabulary cannot tokenize text", "give a Hugging Face checkpoint directory "
         "with its tokenizer, or build a tiny one from your data: python -m dynaresize.data.tiny_model "
         "--data FILE --key KEY --out DIR")
    need(d.max_prompt_length is None or d.max_prompt_length >= 1, "data.max_prompt_length",
         f"is {d.max_prompt_length}", "give a number of tokens, or null for no limit")
    need(d.truncation in ("error", "left", "right"), "data.truncation", f"unknown {d.truncation!r}",
         "use error, left (keep the prompt's end) or right (keep its start)")


def cuda_available() -> bool:
    """Whether torch sees a GPU here (torch is imported only for cluster.device=cuda)."""
    import torch
    return bool(torch.cuda.is_available())

