"""dynaresize.data.tiny_model: a BPE tokenizer trained here and a tiny model that loads with Auto*."""
from __future__ import annotations

import json

import pytest
import torch

from dynaresize.data.tiny_model import IM_END, IM_START, build, main, train_bpe_tokenizer
from word_problems import word_problems, write_word_problems

CHAT = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is 2 + 3?"}]
CHATML = ("<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
          "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = word_problems(200)
    out = build((t for r in rows for t in (r["question"], r["answer"])),
                str(tmp_path_factory.mktemp("tiny")), vocab_size=512)
    return rows, AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)


def test_round_trip(tiny):
    rows, tok, _ = tiny
    texts = [r[k] for r in rows[:20] for k in ("question", "answer")]
    texts += ["  two  spaces, a tab\tand\nnew lines\n", "unseen: Ünïcödé, 😀, 12,345.67%", ""]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    # Trained on the problems, so they take far fewer tokens than bytes.
    assert len(tok.encode(rows[0]["question"])) < len(rows[0]["question"].encode()) / 2


def test_chat_template(tiny):
    _, tok, _ = tiny
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == CHATML
    assert tok.apply_chat_template(CHAT, tokenize=False) == CHATML.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode(CHATML)
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)  # special tokens are single ids
    assert tok.decode(ids, skip_special_tokens=True) == "system\nSolve it.\nuser\nWhat is 2 + 3?\nassistant\n"


def test_special_ids_match_the_model(tiny):
    _, tok, model = tiny
    assert tok.eos_token == IM_END
    assert tok.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    assert tok.pad_token_id == model.config.pad_token_id != tok.eos_token_id


def test_forward_pass(tiny):
    rows, tok, model = tiny
    assert len(tok) <= model.config.vocab_size and model.config.vocab_size % 8 == 0
    ids = tok(rows[0]["question"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_vocab_too_small():
    with pytest.raises(ValueError, match="at least 259"):
        train_bpe_tokenizer(["abc"], vocab_size=100)


def test_cli(tmp_path, capsys):
    from transformers import AutoTokenizer

    pytest.importorskip("pyarrow")
    data = write_word_problems(tmp_path / "wp.parquet", n=50, seed=1, fmt="parquet")
    out = tmp_path / "model"
    main(["--data", str(data), "--key", "question", "--key", "answer", "--out", str(out), "--vocab-size", "300"])
    assert str(out) in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) <= 300
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def test_cli_errors(tmp_path, capsys):
    data = write_word_problems(tmp_path / "wp.jsonl", n=5)
    with pytest.raises(SystemExit) as e:
        main(["--data", str(data), "--key", "prompt", "--out", str(tmp_path / "m")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--key prompt" in err and "available: question, answer, id" in err
    (tmp_path / "wp.csv").write_text("question\n1 + 2\n")
    for path, message in ((tmp_path / "nope.jsonl", "no such file"), (tmp_path / "wp.csv", ".jsonl")):
        with pytest.raises(SystemExit):
            main(["--data", str(path), "--key", "question", "--out", str(tmp_path / "m")])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
