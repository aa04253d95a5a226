"""Memory benchmark: what a train rank holds under FSDP2 on 1, 2, 4 ... ranks, against the memory model.

    dynaresize-bench memory [--ranks 4] [--model qwen2.5-0.5b | small] [--page PATH]

One MPI job. For each train group size k (1, 2, 4 ... up to --ranks; a group per size, created
once), the first k ranks build the model with random weights (a Qwen2 of the named shape, from a
config: nothing is downloaded), shard it with FSDP2 (runtime/fsdp.py), and take one AdamW step on
a random batch; each then measures the bytes it holds of the parameters, gradients and AdamW
state (its local shards). Rank 0 prints, per k, the largest rank's bytes, the memory model's
prediction (plan/memory.py, `trainer.sharding=full`) and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# Qwen2.5-0.5B's config.json (Hugging Face Qwen/Qwen2.5-0.5B; its embeddings are tied, here untied
# as the memory model assumes); `small` is a fast shape for tests.
SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864),
    "small": dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=512),
}
STATES = ("parameters", "gradients", "optimizer")


def spec_of(shape: dict):
    from ..plan.hardware import ModelSpec, qwen2_params
    heads = shape["num_attention_heads"]
    head_dim = shape["hidden_size"] // heads
    params = qwen2_params(shape["vocab_size"], shape["hidden_size"], shape["num_hidden_layers"], heads,
                          shape["num_key_value_heads"], shape["intermediate_size"], head_dim=head_dim)
    return ModelSpec(name="bench", params=float(params), layers=shape["num_hidden_layers"], hidden=shape["hidden_size"],
                     heads=heads, kv_heads=shape["num_key_value_heads"], head_dim=head_dim, weight_bytes=4,
                     vocab=shape["vocab_size"], intermediate=shape["intermediate_size"])


def release_memory() -> None:
    """Hand freed memory back to the system: FSDP's hooks keep reference cycles until collected,
    and glibc keeps freed heap pages until trimmed."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:          # not glibc
        pass


def measure(ctrl, shape: dict, sizes: list[int]) -> list[dict] | None:
    """On every rank: one FSDP2 step per group size; rank 0 returns each size's rows."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ..runtime.fsdp import held_bytes, shard_model
    groups = {k: dist.new_group(list(range(k))) for k in sizes}     # collective: every rank, same order
    rows = []
    for k in sizes:
        held = None
        if ctrl.rank < k:
            torch.manual_seed(0)
            model = shard_model(Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False)), groups[k])
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            ids = torch.randint(0, shape["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            held = held_bytes(model, optimizer)
            del model, optimizer
            release_memory()       # before the next, larger group builds its copies
        parts = ctrl.gather(held)
        if ctrl.rank == 0:
            rows.append({"ranks": k, **{s: max(p[s] for p in parts if p is not None) for s in STATES}})
    return rows if ctrl.rank == 0 else None


def table(rows: list[dict], shape: dict) -> tuple[str, list[dict]]:
    """The measured bytes beside the memory model's, per group size; and the rows with both."""
    from ..plan import memory
    spec, settings = spec_of(shape), memory.TrainSettings(sharding="full")
    lines = [f"{'train ranks':>11} " + " ".join(f"{s + ' GB':>15} {'model':>7} {'ratio':>6}" for s in STATES)]
    out = []
    for r in rows:
        predicted = memory.train_memory(spec, settings, r["ranks"])
        row = {**r, **{f"{s}_model": predicted[s] for s in STATES}}
        out.append(row)
        lines.append(f"{r['ranks']:>11} " + " ".join(f"{r[s] / 1e9:>15.3f} {predicted[s] / 1e9:>7.3f} "
                                                     f"{r[s] / predicted[s]:>6.3f}" for s in STATES))
    return "\n".join(lines), out


def rank_main(argv: list[str]) -> None:
    from ..runtime.comm import ControlPlane
    shape_name, out_dir = argv
    ctrl = ControlPlane()
    try:
        ctrl.init_data_plane("cpu")
        sizes = [k for k in (1, 2, 4, 8, 16, 32) if k <= ctrl.size]
        rows = measure(ctrl, SHAPES[shape_name], sizes)
    except BaseException:
        import traceback
        traceback.print_exc()
        ctrl.abort(1)
        return
    if rows is not None:
        text, rows = table(rows, SHAPES[shape_name])
        with open(os.path.join(out_dir, "memory_bench.json"), "w") as f:
            json.dump({"model": shape_name, "params": spec_of(SHAPES[shape_name]).params, "rows": rows}, f, indent=1)
        print(f"\nFSDP2, {shape_name}, float32 master weights and AdamW; the largest rank of each group:\n{text}",
              flush=True)


def main(argv: list[str]) -> int:
    import subprocess
    import time

    from .local import mpi_env, mpiexec_command
    parser = argparse.ArgumentParser(prog="dynaresize-bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="MPI ranks; groups of 1, 2, 4 ... up to it")
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--out", default=None, help="output dir (default: outputs/memory-bench-TIME)")
    parser.add_argument("--page", default=None, help="also write the table as a results page (Markdown)")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out or time.strftime("outputs/memory-bench-%Y-%m-%d_%H-%M-%S"))
    os.makedirs(out, exist_ok=True)
    print(f"[bench] FSDP2 steps of {args.model} on groups of up to {args.ranks} ranks ...", flush=True)
    cmd = mpiexec_command(args.ranks) + [sys.executable, "-m", "dynaresize.launch.bench_memory", "--rank",
                                         args.model, out]
    code = subprocess.run(cmd, env=mpi_env()).returncode
    if code == 0 and args.page:
        from ..analysis.pages import write_page
        with open(os.path.join(out, "memory_bench.json")) as f:
            rows = json.load(f)["rows"]
        text, _ = table(rows, SHAPES[args.model])
        body = (f"One AdamW step of {args.model} (random weights, {spec_of(SHAPES[args.model]).params / 1e6:.0f}M "
                f"parameters) sharded by FSDP2 over groups of 1, 2, 4 ... ranks (CPU, gloo), float32 master "
                f"weights; per group, the largest rank's bytes of parameters, gradients and AdamW state against "
                f"the memory model (`trainer.sharding=full`, [train memory](../concepts/memory.md)):\n\n"
                f"```\n{text}\n```\n")
        write_page(args.page, "Train memory", ["dynaresize-bench", "memory", *argv], body)
        print(f"results page: {args.page}", flush=True)
    return code


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
