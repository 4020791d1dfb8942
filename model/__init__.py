"""Pure-PyTorch GPT: config, model, KV cache, sampling, tokenizer, checkpoint I/O.

Nothing here imports `training` or `app`; both of those import this package.
"""

from model.config import GPTConfig

__all__ = ["GPTConfig"]
