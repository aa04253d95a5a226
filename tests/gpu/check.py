"""One prepared check of dynaresize's CUDA paths on a machine with one NVIDIA GPU (not part of CI).

Run it with `bash tests/gpu/run.sh` (or `PYTHONPATH=. python3 tests/gpu/check.py [CHECK ...]` to run
some checks only). Each check is timed, asserts numerical results with explicit tolerances, and
is recorded as PASS, FAIL (with the error's first line; its traceback goes to stderr), REFUSED (the
platform declined, not a fault of ours) or SKIP. A table ends the run and the same results go to
$OUT/gpu_check.json (./gpu_check.json without $OUT) after every check, so a run cut short still
leaves what it measured. The whole run stops itself after BUDGET_S.

Without CUDA every check is SKIP and the exit status is 0. DYNARESIZE_GPU_CHECK_DEVICE=cpu runs
the checks that have a CPU path (release/restore, staging, trainer step, and the 2-rank registry
on gloo) on the CPU, to exercise them where there is no GPU. The exit status is 1 if a check FAILs.

About 650 lines on purpose: a lent GPU machine gets one copied script with a fixed time budget, so
every check, its timing and the closing table live in this one file.
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from functools import lru_cache

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:           # run.sh sets PYTHONPATH; this covers a bare `python3 tests/gpu/check.py`
    sys.path.insert(0, REPO)

BUDGET_S = 285                     # the run must end within 5 minutes, with its summary printed
NCCL_PAIR_TIMEOUT_S = 60           # the 2-rank NCCL attempt of nccl_registry
H200_PROFILE = os.path.join(REPO, "dynaresize", "conf", "hardware", "h200.yaml")


def _omegaconf_version() -> str:
    """dynaresize.config (imported by model, trainer, staging, the engines) needs omegaconf."""
    import omegaconf
    return omegaconf.__version__


OMEGACONF = _omegaconf_version()


class Refused(Exception):
    """The platform declined something we asked for (e.g. NCCL with two ranks on one GPU)."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gb(nbytes: float) -> float:
    return nbytes / 1e9


# --- 1. CUDA IPC weight hand-off (dynaresize.runtime.rollout.vllm_engine) ------------------------------
# Qwen2.5-0.5B (config.json): vocab 151936, hidden 896, 24 layers, 14 heads / 2 KV heads of 64,
# intermediate 4864, tied embeddings: 494M parameters, 0.99 GB in bf16, 290 tensors.
QWEN05B = dict(vocab=151936, hidden=896, layers=24, kv_dim=2 * 64, intermediate=4864)


def qwen_like_shapes(vocab: int, hidden: int, layers: int, kv_dim: int, intermediate: int) -> list:
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.q_proj.bias", (hidden,)),
                   (p + "self_attn.k_proj.weight", (kv_dim, hidden)), (p + "self_attn.k_proj.bias", (kv_dim,)),
                   (p + "self_attn.v_proj.weight", (kv_dim, hidden)), (p + "self_attn.v_proj.bias", (kv_dim,)),
                   (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "mlp.gate_proj.weight", (intermediate, hidden)),
                   (p + "mlp.up_proj.weight", (intermediate, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, intermediate)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    return shapes + [("model.norm.weight", (hidden,))]


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32}


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two exact integers over the tensor's bit patterns, the second position-weighted: equal
    fingerprints mean equal bits (barring a collision), computed where the tensor is."""
    bits = t.reshape(-1).view(_SAME_SIZE_INT[t.element_size()]).long()
    weights = torch.arange(bits.numel(), device=t.device) % 65521 + 1
    return int(bits.sum()), int((bits * weights).sum())


def _ipc_consumer(conn, device: str) -> None:
    """The second process: vLLM's worker side of the hand-off. It runs the project's
    WorkerExtension.dynaresize_load_ipc (decode, args[6] = this process's device,
    rebuild_cuda_tensor, synchronize); only the final load is replaced by a copy into buffers
    of its own, which it fingerprints."""
    try:
        from dynaresize.runtime.rollout.vllm_engine import WorkerExtension

        class Consumer(WorkerExtension):
            def __init__(self, buffers):
                self.buffers = buffers

            def _dynaresize_reload(self, weights) -> None:
                with torch.no_grad():
                    for name, t in weights:
                        self.buffers[name].copy_(t)

        if device == "cuda":
            torch.cuda.set_device(0)
        spec = conn.recv()
        consumer = Consumer({n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in spec})
        conn.send(("ready", None))
        while (handles := conn.recv()) is not None:
            t0 = time.monotonic()
            consumer.dynaresize_load_ipc(handles)       # returns after torch.cuda.synchronize()
            done = time.monotonic()
            prints = [fingerprint(consumer.buffers[n]) for n, _ in spec]
            conn.send(("loaded", (done, done - t0, prints)))
    except EOFError:                                    # the parent is gone
        pass
    except Exception as e:  # noqa: BLE001 - reported to the parent, which records the failure
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _receive(conn, proc, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the consumer process sent nothing within {timeout_s:.0f} s "
                           f"(alive: {proc.is_alive()})")
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(f"consumer process: {payload}")
    return payload


def ipc_handoff(device: str, shapes: list, rounds: int = 2) -> dict:
    """Hand `shapes` (random bf16) to a spawned process `rounds` times, with new values each round:
    the first round opens the IPC handles cold, the next ones show a repeated weight update."""
    from dynaresize.runtime.rollout.vllm_engine import _ipc_handles

    gen = torch.Generator(device=device).manual_seed(0)
    named = [(n, torch.empty(s, dtype=torch.bfloat16, device=device)) for n, s in shapes]
    total = sum(t.numel() * t.element_size() for _, t in named)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_ipc_consumer, args=(child_conn, device), daemon=True)
    proc.start()
    figures = {"GB": gb(total), "tensors": len(named)}
    try:
        conn.send(shapes)
        _receive(conn, proc, 120)           # the child's interpreter, torch and CUDA context are up
        for r in range(rounds):
            for _, t in named:
                t.normal_(generator=gen)
            sync(device)
            expected = [fingerprint(t) for _, t in named]
            # time.monotonic is CLOCK_MONOTONIC, one clock for every process on the machine.
            t0 = time.monotonic()
            handles = _ipc_handles(named)
            t_handles = time.monotonic() - t0
            conn.send(handles)
            done, t_load, got = _receive(conn, proc, 60)
            bad = [n for (n, _), a, b in zip(named, expected, got) if a != b]
            expect(not bad, f"round {r}: {len(bad)} of {len(named)} tensors differ after the hand-off "
                            f"(first: {bad[:1]})")
            label = "cold" if r == 0 else "warm"
            figures.update({f"{label}_GB/s": gb(total) / (done - t0),
                            f"{label}_handles_ms": 1e3 * t_handles, f"{label}_load_ms": 1e3 * t_load})
        conn.send(None)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    return figures


def check_cuda_ipc_handoff(device: str) -> dict:
    """vLLM's CUDA weight update path: _ipc_handles here, dynaresize_load_ipc in another process."""
    return ipc_handoff(device, qwen_like_shapes(**QWEN05B))


# --- 2. TorchEngine release / restore ----------------------------------------------------------
@lru_cache(maxsize=None)
def checkpoint(device: str) -> str:
    """A Qwen2 checkpoint with random weights, built by the project's helpers: 24M parameters on
    CUDA (enough to see memory move), the tests' tiny default on the CPU."""
    from dynaresize.config import ModelConfig
    from dynaresize.data.model import prepare_checkpoint

    cfg = (ModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)
           if device == "cuda" else ModelConfig())
    directory = tempfile.mkdtemp(prefix="dynaresize-gpu-check-model-")
    atexit.register(shutil.rmtree, directory, True)
    return prepare_checkpoint(cfg, directory)


def group_requests(prompts: int = 4, samples: int = 4) -> list:
    from dynaresize.config import WorkloadConfig
    from dynaresize.runtime.rollout.base import GroupRequest
    from dynaresize.data.workload import make_batch, sample_seed

    return [GroupRequest(p, tuple(sample_seed(1234, 0, p.index, j) for j in range(samples)), p.index * samples)
            for p in make_batch(WorkloadConfig(), 1234, 0, prompts, samples)]


def check_torch_engine_release_restore(device: str) -> dict:
    from dynaresize.runtime.rollout.torch_engine import TorchEngine

    requests = group_requests()
    engine = TorchEngine(checkpoint(device), dtype="float32", device=device)
    model_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    before = engine.generate(requests, temperature=1.0)
    figures = {"model_MB": model_bytes / 2**20, "tokens": sum(len(g.tokens) for grp in before for g in grp)}

    allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
    t0 = time.perf_counter()
    engine.release()
    figures["release_ms"] = 1e3 * (time.perf_counter() - t0)
    if device == "cuda":
        freed = allocated - torch.cuda.memory_allocated()
        gc.collect()                        # diagnostic only: what reference cycles were still holding
        figures["freed_MB"] = freed / 2**20
        figures["freed_after_gc_MB"] = (allocated - torch.cuda.memory_allocated()) / 2**20
        expect(freed >= 0.9 * model_bytes, f"release() freed {freed / 2**20:.1f} MB of CUDA memory, "
                                           f"less than 90% of the {model_bytes / 2**20:.1f} MB of weights")

    t0 = time.perf_counter()
    engine.restore()
    figures["restore_ms"] = 1e3 * (time.perf_counter() - t0)
    after = engine.generate(requests, temperature=1.0)
    engine.close()

    rows = [(a, b) for group_a, group_b in zip(before, after) for a, b in zip(group_a, group_b)]
    expect(all(a.tokens == b.tokens for a, b in rows), "tokens differ after release/restore with the same seeds")
    drift = max(abs(x - y) for a, b in rows for x, y in zip(a.logprobs, b.logprobs))
    expect(drift <= 1e-5, f"log-probs differ by {drift:.3g} after release/restore (tolerance 1e-5)")
    figures["logprob_max_diff"] = drift
    return figures


# --- 3. staging from and back to the GPU -------------------------------------------------------
def check_staging_from_gpu(device: str) -> dict:
    """A ShardState of 3 x 89.5M float32 (1.07 GB) on the GPU, staged to local disk and read back.
    The range starts at an odd offset and ends mid-chunk, as a rank's range of the flat vector does."""
    from dynaresize.runtime.staging import (new_run_id, read_range, remove_dir, scratch_root, shard_path,
                                            write_shard)
    from dynaresize.runtime.types import ShardState

    n = 89_478_487 if device == "cuda" else 2_000_003
    lo, version = 1001, 3
    gen = torch.Generator(device=device).manual_seed(1)
    fields = [torch.randn(n, generator=gen, device=device) for _ in range(3)]
    shard = ShardState(lo, lo + n, *fields, step=7)
    directory = tempfile.mkdtemp(prefix="dynaresize-gpu-check-staging-", dir=scratch_root(None))
    run_id = new_run_id()
    try:
        path = shard_path(directory, version, 0)
        sync(device)
        t0 = time.perf_counter()
        nbytes = write_shard(path, shard, version, buffer_mb=4, run_id=run_id)   # the StagingConfig default
        t_write = time.perf_counter() - t0

        t0 = time.perf_counter()
        arrays, step = read_range(path, version, lo, lo + n, run_id)
        back = [torch.from_numpy(arrays[name]).to(device) for name in ("params", "exp_avg", "exp_avg_sq")]
        sync(device)
        t_read = time.perf_counter() - t0
        expect(step == 7, f"step {step} read back, 7 staged")
        expect(all(torch.equal(a, b) for a, b in zip(fields, back)), "staged state differs from the original")

        a, b = lo + 12_345, lo + n - 777        # a sub-range whose ends fall inside chunks
        part, _ = read_range(path, version, a, b, run_id)
        expect(torch.equal(torch.from_numpy(part["exp_avg"]).to(device), fields[1][a - lo:b - lo]),
               "a sub-range read back differs from the original")
        return {"GB": gb(nbytes), "write_GB/s": gb(nbytes) / t_write, "read_GB/s": gb(nbytes) / t_read,
                "file_GB": gb(os.path.getsize(path))}
    finally:
        remove_dir(directory)


# --- 4. one ShardedTrainer step ----------------------------------------------------------------
@contextmanager
def single_rank_world(device: str):
    """torch.distributed with one rank (NCCL on CUDA, gloo on the CPU), destroyed on the way out."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def timed(device: str, fn, *args):
    """(seconds, result) of fn(*args), the device's queued work included."""
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args)
    sync(device)
    return time.perf_counter() - t0, out


def make_samples() -> list:
    """16 samples of 4 prompts with long-tailed response lengths, as tests/test_trainer.py builds
    them (engine log-probs are placeholder zeros)."""
    import numpy as np
    from dynaresize.data.model import BOS_ID, EOS_ID
    from dynaresize.runtime.types import Sample

    rng = np.random.default_rng(0)
    samples = []
    for i, r in enumerate([2, 3, 5, 40, 4, 6, 3, 25, 8, 2, 12, 3, 60, 5, 4, 7]):
        prompt_tokens = [BOS_ID] + rng.integers(3, 15, 4 + i // 4).tolist()
        response = rng.integers(3, 15, r - 1).tolist() + [EOS_ID]
        samples.append(Sample(0, i, i // 4, 1, prompt_tokens, response, [0.0] * r, 64, float(rng.random())))
    return samples


def check_trainer_step_cuda(device: str) -> dict:
    from dynaresize.config import TrainerConfig
    from dynaresize.data.model import load_model
    from dynaresize.runtime.trainer import ShardedTrainer

    cfg = TrainerConfig()
    samples = make_samples()
    with single_rank_world(device) as dist:
        x = torch.full((4,), 3.0, device=device)
        dist.all_reduce(x)
        expect(torch.equal(x, torch.full_like(x, 3.0)), f"all_reduce over one rank changed the tensor: {x.tolist()}")

        trainer = ShardedTrainer(load_model(checkpoint(device), "float32", device), cfg, 1.0, device=device)
        trainer.join(dist.group.WORLD, [0], 0)
        weights = trainer.flat.clone()
        t_first, info = timed(device, trainer.train_step, samples)   # with kernel selection, allocation
        step = (trainer.flat - weights).abs()
        t_second, _ = timed(device, trainer.train_step, samples)
    expect(math.isfinite(info["loss"]) and math.isfinite(info["grad_norm"]) and info["grad_norm"] > 0,
           f"loss {info['loss']}, grad norm {info['grad_norm']}: want finite, and a non-zero gradient")
    expect(bool(torch.isfinite(trainer.flat).all()), "non-finite weights after the step")
    # AdamW's first step moves each weight with a gradient by lr * g / (|g| + eps): at most lr.
    biggest = float(step.max())
    expect(0.5 * cfg.lr <= biggest <= 1.001 * cfg.lr,
           f"largest weight change {biggest:.3g} after the first AdamW step, expected about lr={cfg.lr}")
    return {"step1_s": t_first, "step2_s": t_second, "loss": info["loss"], "grad_norm": info["grad_norm"],
            "moved_frac": float((step > 0).float().mean()), "max_dw": biggest}


# --- 5. GroupRegistry over NCCL ----------------------------------------------------------------
def registry_rank(rank: int, port: int, backend: str) -> None:
    """One rank of a 2-rank world (both on cuda:0 with NCCL): every group of the registry reduces
    a tensor of ones; prints the sums as a RESULT line."""
    import torch.distributed as dist
    from dynaresize.runtime.groups import GroupRegistry

    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=NCCL_PAIR_TIMEOUT_S - 15))
    registry = GroupRegistry(world=2, resize_unit=1)
    sums = {}
    for kind, k in (("train", 1), ("rollout", 1), ("sync", 1), ("train", 2)):
        members = registry.members(kind, k)
        if rank in members:
            x = torch.ones(1, device=device)
            dist.all_reduce(x, group=registry.get(kind, k))
            expect(float(x) == len(members), f"{kind}[{k}]: all_reduce of ones gave {float(x)}, want {len(members)}")
            sums[f"{kind}{k}"] = float(x)
    dist.destroy_process_group()
    print("RESULT", json.dumps({"rank": rank, "sums": sums}), flush=True)


def run_rank_pair(backend: str) -> tuple[list[int | None], list[str]]:
    """Both ranks as subprocesses of this script; killed if they are not done in time."""
    port = free_port()
    env = dict(os.environ, NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"))
    logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "_registry_rank", str(r), str(port), backend],
                              stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
             for r, log in enumerate(logs)]
    deadline = time.monotonic() + NCCL_PAIR_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return [p.returncode for p in procs], outputs


def check_nccl_registry(device: str) -> dict:
    """World 1 (no splits: every group is WORLD) in this process, then a 2-rank world in two
    processes on the one GPU, which NCCL is expected to refuse ("Duplicate GPU detected")."""
    from dynaresize.runtime.groups import GroupRegistry

    with single_rank_world(device) as dist:
        registry = GroupRegistry(world=1, resize_unit=1)
        expect(registry.splits == [] and registry.get("train", 1) is dist.group.WORLD,
               f"world 1: splits {registry.splits}, train[1] is not WORLD")
        x = torch.ones(2, device=device)
        dist.all_reduce(x, group=registry.get("train", 1))
        expect(torch.equal(x, torch.ones_like(x)), f"world 1 all_reduce gave {x.tolist()}")

    backend = "nccl" if device == "cuda" else "gloo"
    t0 = time.monotonic()
    codes, outputs = run_rank_pair(backend)
    figures = {"backend": backend, "pair_s": time.monotonic() - t0}
    if codes == [0, 0] and all("RESULT" in out for out in outputs):
        return figures
    text = "\n".join(outputs)
    duplicate = re.search(r"^.*Duplicate GPU.*$", text, re.M | re.I)
    if duplicate:
        raise Refused(f"world 1 passed; 2 ranks on one GPU: {duplicate.group(0).strip()}")
    for out in outputs:
        sys.stderr.write(out[-3000:])
    if None in codes or -9 in codes:
        raise TimeoutError(f"2-rank {backend} world did not finish within {NCCL_PAIR_TIMEOUT_S} s (killed)")
    last = [out.strip().splitlines()[-1] if out.strip() else "" for out in outputs]
    raise RuntimeError(f"2-rank {backend} world: exit codes {codes}; last lines {last}")


# --- 6. bf16 matmul and copy ceilings ----------------------------------------------------------
def profile_figure(key: str) -> float:
    """A top-level number of dynaresize/conf/hardware/h200.yaml (read as text: no omegaconf/yaml needed)."""
    with open(H200_PROFILE) as f:
        found = re.search(rf"^{key}:\s*([0-9.eE+-]+)", f.read(), re.M)
    return float(found.group(1))


def cuda_median_s(fn, repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def check_bf16_matmul(device: str, n: int = 8192, copy_bytes: int = 2**30) -> dict:
    gen = torch.Generator(device=device).manual_seed(2)
    a, b = (torch.randn(n, n, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    t_mm = cuda_median_s(lambda: torch.matmul(a, b, out=c))
    ref = a[:256].double() @ b.double()
    err = float((c[:256].double() - ref).abs().max() / ref.abs().max())
    expect(err <= 1e-2, f"bf16 matmul rows 0-255 off the float64 product by {err:.3g} of its max (tolerance 1e-2)")
    del a, b, c, ref

    src = torch.randn(copy_bytes // 4, generator=gen, device=device)      # float32
    dst = torch.empty_like(src)
    t_copy = cuda_median_s(lambda: dst.copy_(src))
    expect(torch.equal(dst, src), "device-to-device copy differs from its source")
    tflops = 2 * n**3 / t_mm / 1e12
    copy_gbs = 2 * gb(src.numel() * 4) / t_copy                # bytes read plus bytes written
    return {"TFLOP/s": tflops, "of_peak": tflops * 1e12 / profile_figure("peak_flops"), "rel_err": err,
            "copy_GB/s(r+w)": copy_gbs, "of_hbm": copy_gbs * 1e9 / profile_figure("hbm_bandwidth")}


# --- 7. one step of the fully sharded trainer against the memory model, and its reshard storage --
def check_fsdp2_step_memory(device: str) -> dict:
    """One GRPO step of the runtime's fully sharded trainer (runtime/fsdp.py: FSDP2, AdamW) on a
    Qwen2.5-1.5B-shaped model (random weights) in bf16 with float32 master weights and activation
    checkpointing, on one GPU: its peak allocated memory against plan/memory.py's prediction
    (reserve excluded), step time and MFU. Then its state saved from GPU memory through DCP over
    HDF5 (runtime/dcp_h5.py, what a resize and a checkpoint write) and loaded back into a second
    trainer, bit for bit. The CPU path runs a small shape in float32 and checks the sharded
    states and the round trip."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dynaresize.config import TrainerConfig
    from dynaresize.launch.bench_memory import SHAPES, spec_of
    from dynaresize.plan import memory
    from dynaresize.runtime.fsdp import FullyShardedTrainer, held_bytes
    from dynaresize.runtime.staging import new_run_id, remove_dir, scratch_root
    from dynaresize.runtime.types import Sample

    cuda = device == "cuda"
    shape = (dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, intermediate_size=8960) if cuda else SHAPES["small"])
    batch, length = (4, 1024) if cuda else (2, 32)
    compute = "bfloat16" if cuda else "float32"
    cfg = TrainerConfig(lr=1e-5, micro_batch_size=batch, activation_checkpointing=True, grad_reduce_dtype="float32")
    gen = torch.Generator().manual_seed(0)
    # one micro-batch: a prompt group of `batch` responses of `length` tokens, rewards that differ
    samples = [Sample(0, i, 0, 0, [1] * 16, torch.randint(3, shape["vocab_size"], (length - 16,), generator=gen).tolist(),
                      [0.0] * (length - 16), length, float(i)) for i in range(batch)]

    def trainer_on(group, seed: int):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False))
        return FullyShardedTrainer(model, cfg, 1.0, device, group, [0], 0, compute_dtype=compute)

    directory = tempfile.mkdtemp(prefix="dynaresize-gpu-check-dcp-", dir=scratch_root(None))
    try:
        with single_rank_world(device) as dist:
            trainer = trainer_on(dist.group.WORLD, seed=0)
            held: dict[str, int] = {}

            def step():                                   # what it holds with the gradients in place
                grad, info = trainer.compute_gradient(samples)
                held.update(held_bytes(trainer.model, trainer.optimizer))
                trainer.apply_gradient(grad)
                return info
            step()                                        # the optimizer state exists from here on
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            seconds, info = timed(device, step)
            peak = torch.cuda.max_memory_allocated() if cuda else math.nan
            run_id = new_run_id()
            t_save, written = timed(device, trainer.save, directory, run_id)
            other = trainer_on(dist.group.WORLD, seed=1)          # other weights, overwritten by the load
            t_load, read = timed(device, other.load, directory, run_id)
            same = all(torch.equal(a.to_local(), b.to_local()) for a, b in
                       zip(trainer.model.parameters(), other.model.parameters()))
            moments = [(trainer.optimizer.state[a], other.optimizer.state[b]) for a, b in
                       zip(trainer.model.parameters(), other.model.parameters())]
            same_state = all(torch.equal(x[key].to_local(), y[key].to_local()) for x, y in moments
                             for key in ("exp_avg", "exp_avg_sq"))
    finally:
        remove_dir(directory)
    expect(math.isfinite(info["loss"]) and info["grad_norm"] > 0, f"loss {info['loss']}, grad norm {info['grad_norm']}")
    expect(same and same_state, "the state loaded back through DCP over HDF5 differs from the saved one")
    spec = spec_of(shape)
    settings = memory.TrainSettings(sharding="full", compute_bytes=2 if cuda else 4, reduce_bytes=4,
                                    activation_checkpointing=True, micro_batch_tokens=batch * length)
    predicted = memory.train_memory(spec, settings, 1)
    for state in ("parameters", "gradients", "optimizer"):
        expect(abs(held[state] / predicted[state] - 1) <= 0.15,
               f"{state}: {gb(held[state]):.3f} GB held, the memory model says {gb(predicted[state]):.3f} GB")
    out = {"params_M": spec.params / 1e6, "step_s": seconds, "states_GB": gb(sum(held.values())),
           "dcp_save_GB/s": gb(written) / t_save, "dcp_load_GB/s": gb(read) / t_load}
    if cuda:
        out.update({"peak_GB": gb(peak), "model_GB": gb(sum(predicted.values())),
                    "peak/model": peak / sum(predicted.values()),
                    # forward, backward and the checkpointed layers' forward again: 8 FLOPs a parameter a token
                    "MFU": 8 * spec.params * batch * length / seconds / profile_figure("peak_flops")})
    return out


# --- the run -----------------------------------------------------------------------------------
CHECKS = [  # name, function, has a CPU path (DYNARESIZE_GPU_CHECK_DEVICE=cpu)
    ("cuda_ipc_handoff", check_cuda_ipc_handoff, False),
    ("torch_engine_release_restore", check_torch_engine_release_restore, True),
    ("staging_from_gpu", check_staging_from_gpu, True),
    ("trainer_step_cuda", check_trainer_step_cuda, True),
    ("nccl_registry", check_nccl_registry, True),
    ("bf16_matmul", check_bf16_matmul, False),
    ("fsdp2_step_memory", check_fsdp2_step_memory, True),
]


def environment(device: str | None) -> dict:
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "omegaconf": OMEGACONF,
           "device": device or "none (no CUDA)"}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_GiB=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        try:
            nccl = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as e:  # noqa: BLE001 - a build without NCCL still runs the other checks
            env["nccl"] = f"unknown ({type(e).__name__}: {e})"
    return env


def run_check(name: str, fn, device: str) -> dict:
    print(f"== {name} ({device})", flush=True)
    t0 = time.monotonic()
    figures, message = {}, ""
    try:
        figures, result = fn(device), "PASS"
    except Refused as e:
        result, message = "REFUSED", str(e)
    except Exception as e:  # noqa: BLE001 - one failing check must not stop the others
        traceback.print_exc()
        lines = str(e).strip().splitlines()
        result, message = "FAIL", f"{type(e).__name__}: {lines[0] if lines else ''}"
    finally:
        gc.collect()
        if device == "cuda":
            with contextlib.suppress(Exception):   # after a sticky CUDA error, already recorded above
                torch.cuda.empty_cache()
    record = {"check": name, "result": result, "seconds": round(time.monotonic() - t0, 2),
              "figures": {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()},
              "message": message}
    print(f"   {result} in {record['seconds']} s {message} {record['figures']}", flush=True)
    return record


def save(report: dict) -> str:
    path = os.path.join(os.environ.get("OUT") or ".", "gpu_check.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return path


def describe(r: dict) -> str:
    text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["figures"].items())
    return f"{text} {r['message']}".strip()


def write_results_page(path: str, report: dict, argv: list[str]) -> None:
    """The docs' results page of this run (`--page PATH`): the machine, then one row per check."""
    from dynaresize.analysis.pages import write_page
    env = report["environment"]
    lines = ["Machine: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             "| check | result | figures |", "|---|---|---|"]
    lines += [f"| `{r['check']}` | {r['result']} | {describe(r)} |" for r in report["checks"]]
    write_page(path, "GPU check", ["bash", "tests/gpu/run.sh", *argv], "\n".join(lines))


def print_table(records: list[dict]) -> None:
    width = max(len(r["check"]) for r in records)
    print(f"\n{'check':<{width}} | result  | key figures")
    for r in records:
        print(f"{r['check']:<{width}} | {r['result']:<7} | {describe(r)}", flush=True)


def main(argv: list[str]) -> int:
    selected, page = list(argv), None
    if "--page" in selected:                   # --page PATH: also write the docs' results page
        at = selected.index("--page")
        page = selected[at + 1] if at + 1 < len(selected) else None
        del selected[at:at + 2]
        if page is None:
            print("--page needs a path, e.g. --page docs/results/gpu-check.md", file=sys.stderr)
            return 2
    faulthandler.dump_traceback_later(BUDGET_S, exit=True)   # never outlive the time budget
    wanted = os.environ.get("DYNARESIZE_GPU_CHECK_DEVICE", "cuda")
    device = "cpu" if wanted == "cpu" else ("cuda" if torch.cuda.is_available() else None)
    report = {"environment": environment(device), "checks": []}
    print(json.dumps(report["environment"]), flush=True)
    unknown = set(selected) - {name for name, _, _ in CHECKS}
    if unknown:
        print(f"unknown checks {sorted(unknown)}; known: {[name for name, _, _ in CHECKS]}", file=sys.stderr)
        return 2
    for name, fn, cpu_path in CHECKS:
        if selected and name not in selected:
            continue
        if device is None or (device == "cpu" and not cpu_path):
            skip = "no CUDA" if device is None else "needs CUDA"
            report["checks"].append({"check": name, "result": "SKIP", "seconds": 0.0, "figures": {},
                                     "message": f"({skip})"})
        else:
            report["checks"].append(run_check(name, fn, device))
        path = save(report)
    print_table(report["checks"])
    print(f"results: {path}", flush=True)
    if page:
        write_results_page(page, report, argv)
        print(f"results page: {page}", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 1 if any(r["result"] == "FAIL" for r in report["checks"]) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_registry_rank"]:
        registry_rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(main(sys.argv[1:]))
