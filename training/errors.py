"""What `python -m training.train` shows the user when something is wrong: one line, `PROG: error: ...`."""

PROG = "python -m training.train"


class TrainError(RuntimeError):
    """A user-facing problem (bad flags, mismatched checkpoint or data); printed in one line."""
