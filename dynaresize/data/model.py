"""The policy model: a Hugging Face causal LM, either a given checkpoint or a tiny Qwen2 built here.

Nothing is downloaded. The tiny model and its character-level tokenizer are built from a config
with a fixed seed and saved in the Hugging Face format, so the trainer, the torch rollout engine
and vLLM all start from the same directory.
"""
from __future__ import annotations

import inspect
import os

import torch

from ..config import ModelConfig

from .vocab import BOS_ID, CHARS, EOS_ID, PAD_ID, SPECIAL, VOCAB_SIZE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def import_model_code() -> None:
    """Import transformers' model classes: seconds of CPU a rank spends once, wherever it first
    needs them. The job does it on every rank at once, while rank 0 writes the initial model."""
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")


def build_tiny_model(cfg: ModelConfig, vocab_size: int = VOCAB_SIZE, bos_id: int = BOS_ID,
                     eos_id: int = EOS_ID, pad_id: int = PAD_ID):
    """A small Qwen2 with random weights (seeded by cfg.init_seed); the defaults fit the character
    vocabulary of the built-in tasks, a trained tokenizer passes its own size and special ids."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position,
        tie_word_embeddings=False, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        torch_dtype=cfg.dtype,
    )
    with torch.random.fork_rng():
        torch.manual_seed(cfg.init_seed)
        model = Qwen2ForCausalLM(config)
    return model.to(DTYPES[cfg.dtype])


def prepare_checkpoint(cfg: ModelConfig, directory: str) -> str:
    """The checkpoint directory every rank loads: `cfg.path`, or the tiny model saved to `directory`."""
    if cfg.path is not None:
        return cfg.path
    quiet_transformers()
    build_tiny_model(cfg).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


def eos_token_ids(path: str) -> list[int]:
    """The checkpoint's end-of-sequence ids (generation_config.json, else config.json): generation
    stops at any of them."""
    import json
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(path, name)) as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if value is not None:
            return [int(v) for v in (value if isinstance(value, list) else [value])]
    return [EOS_ID]


def load_model(path: str, dtype: str = "float32", device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.to(device)


def save_model(model, path: str, tokenizer_from: str | None = None) -> None:
    quiet_transformers()
    model.save_pretrained(path)
    if tokenizer_from and os.path.exists(os.path.join(tokenizer_from, "tokenizer.json")):
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)


def cache_kwarg(model) -> str:
    """Name of the KV-cache argument of forward(): 'cache' in transformers 5.x, 'past_key_values' before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def trainable_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters in a fixed order: the layout of the flat parameter vector on every rank."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def empty_model(path: str):
    """The model with its parameters on the meta device (no memory, no values) but its buffers
    computed (the rotary frequencies, which no checkpoint holds): what a fully sharded trainer
    shards and then fills from saved state. Each parameter is created and moved to meta on its
    own, so at most one parameter's memory exists at a time."""
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    finally:
        torch.nn.Module.register_parameter = register


def model_skeleton(path: str):
    """The model's structure without weights (meta device): enough to know the flat layout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
