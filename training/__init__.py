"""Training utilities: tokenizer training, data preparation and the training loop."""
