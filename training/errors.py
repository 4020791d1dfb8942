"""What the trainers' command lines show the user when something is wrong: one line, `PROG: error: ...`
(`python -m training.train`'s PROG; FINETUNE_PROG for `python -m training.finetune`, task and chat)."""

PROG = "python -m training.train"
FINETUNE_PROG = "python -m training.finetune"


class TrainError(RuntimeError):
    """A user-facing problem (bad flags, mismatched checkpoint or data); printed in one line."""
