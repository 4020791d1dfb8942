"""Supervised task fine-tuning (python -m training.finetune --task KIND): labelled data, the loop, accuracy."""
