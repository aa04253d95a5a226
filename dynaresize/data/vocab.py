"""The character vocabulary of the built-in digit tasks (workload.py) and the tiny model built for
them (model.py); torch-free, so the cost model can size the tiny model without importing torch."""

SPECIAL = ("<pad>", "<bos>", "<eos>")     # ids 0-2
CHARS = "0123456789=+"                    # ids 3 onwards
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 32  # len(SPECIAL) + len(CHARS), padded to a multiple of 8; ids above are never targets
