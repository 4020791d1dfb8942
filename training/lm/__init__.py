"""Language-model pre-training (python -m training.train): token data, the loop, the evaluation loss."""
