"""Chat supervised fine-tuning (python -m training.finetune --task chat): conversations, the loop, measurements."""
