"""What a job learns from: the policy model's files, the prompts and the rewards.

`model` loads a Hugging Face causal LM (or builds the tiny one), `workload` and `datasets` make the
prompts (built-in digit tasks, or your JSONL/Parquet rows), `shapes` gives every batch its shape
(one pure function, shared with the simulator), `rewards` scores the responses, and `tiny_model`
builds a tiny model with a tokenizer trained on your texts.
"""
