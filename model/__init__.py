"""The network, pure PyTorch: config, model, KV cache layout, the Linear kernels and weight formats (linear,
quantize), tokenizer, checkpoint I/O, converters and exports.

Nothing here imports `engine`, `training` or `app` (tests/test_layers.py); they import this package.
"""

from model.config import GPTConfig

__all__ = ["GPTConfig"]
