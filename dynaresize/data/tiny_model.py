"""A tiny Hugging Face model directory with a real BPE tokenizer trained here, on your own texts.

For trying the toolkit on one's own data without downloading a model (and for tests): a byte-level
BPE tokenizer with ChatML special tokens and chat template (like Qwen's), and a small Qwen2 with
random weights (dynaresize.data.model.build_tiny_model) sized to it, saved together with save_pretrained.

    python -m dynaresize.data.tiny_model --data train.jsonl --key question --key answer --out tiny/

then point `model.path` at the directory.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Optional

from ..config import ModelConfig
from .datasets import read_file
from .model import build_tiny_model, quiet_transformers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# ChatML, as Qwen's template writes it (without the tool-calling parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's split before byte-level BPE (single digits, words with their leading space, ...).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                           r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Byte-level BPE starts from all 256 byte symbols, so smaller vocabularies cannot hold them.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on `texts`, Qwen2-style: any (NFC) text round-trips,
    even characters never seen; pad "<|endoftext|>", eos "<|im_end|>", ChatML chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size is {vocab_size}; a byte-level BPE needs at least {MIN_VOCAB} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tok = Tokenizer(models.BPE())
    # Qwen2's pipeline exactly: transformers 5 rebuilds a qwen2 checkpoint's tokenizer with it on
    # load (Qwen2Tokenizer), so training with anything else would encode differently once saved.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(texts: Iterable[str], out_dir: str, vocab_size: int = 512,
          model_cfg: Optional[ModelConfig] = None) -> str:
    """Train the tokenizer on `texts`, build the tiny model for it, save both into `out_dir`."""
    from transformers import GenerationConfig

    cfg = model_cfg or ModelConfig()
    tokenizer = train_bpe_tokenizer(texts, vocab_size)
    tokenizer.model_max_length = cfg.max_position
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    size = -(-len(tokenizer) // 8) * 8  # a multiple of 8; the ids above the tokenizer are never sampled targets
    quiet_transformers()
    model = build_tiny_model(cfg, vocab_size=size, bos_id=ids[ENDOFTEXT], eos_id=ids[IM_END],
                             pad_id=ids[ENDOFTEXT])
    # generate() and vLLM stop on the generation config's eos.
    model.generation_config = GenerationConfig(bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END],
                                               pad_token_id=ids[ENDOFTEXT])
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def row_texts(rows: list[dict], keys: list[str], source: str = "the data") -> Iterator[str]:
    """The fields `keys` of every row, as text; a missing key names the keys there are."""
    for n, row in enumerate(rows, 1):
        for key in keys:
            if key not in row:
                raise ValueError(f"--key {key}: row {n} of {source} has no field {key!r}; "
                                 f"available: {', '.join(map(str, row))}")
            if row[key] is not None:
                yield str(row[key])


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dynaresize.data.tiny_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a .jsonl, .json or .parquet file of rows")
    parser.add_argument("--key", action="append", required=True,
                        help="a field whose text the tokenizer learns from (repeatable)")
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args(argv)
    try:
        rows = read_file(args.data)
        if not rows:
            raise ValueError(f"--data {args.data}: no rows")
        texts = list(row_texts(rows, args.key, args.data))  # check every row before training
        build(texts, args.out, args.vocab_size)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(args.out)
    print(f"wrote {args.out}: a byte-level BPE tokenizer (eos {IM_END!r}, ChatML template) trained on "
          f"{len(texts)} texts from {args.data} [{', '.join(args.key)}], and a tiny {config.model_type} "
          f"(vocabulary {config.vocab_size}, {config.num_hidden_layers} layers, hidden {config.hidden_size}); "
          f"use it with model.path={args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
