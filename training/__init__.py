"""Training: tokenizer training, data preparation, the trainers (lm/, task/, chat/; one folder each) and, at the
top level, their command lines and the pieces they share."""
