"""Train (or fine-tune) the GPT of model/ on a prepared data directory.

Usage::

    python -m training.train --data data/shakespeare --out runs/shakespeare --config training/configs/shakespeare.json
    python -m training.train --data DIR --out OUT --resume                 # continue OUT/last exactly
    python -m training.train --data DIR --out OUT --init-from checkpoints/gpt2 --set learning_rate=3e-5
    torchrun --nproc_per_node 2 -m training.train --data DIR --out OUT   # data parallel (gloo on CPU, NCCL on GPU)

Writes OUT/last (newest; with training_state.pt for --resume), OUT/best (lowest
validation loss; weights only), OUT/metrics.jsonl and OUT/loss.png (and with
--tensorboard, OUT/tensorboard). Every checkpoint write is atomic
(model.checkpoint.save_checkpoint), so killing the process at any moment leaves
the previous checkpoint loadable.

Reproducibility: on CPU a run is a pure function of (config, data, seed, number
of processes and threads). Training batches are a pure function of (seed, rank,
step, micro-step) (training.lm.data.BatchSampler), and the RNG states of torch,
numpy and python are saved with the optimizer, so `--resume` continues with
exactly the losses the uninterrupted run would have had.

This file is the command line and the order of things; each piece has its own module:
training/lm/build_model.py (the model: fresh, --resume, --init-from), training/optim.py (AdamW, LR schedule),
training/distributed.py (torchrun/DDP), training/checkpoints.py (OUT/last and OUT/best, resume state, RNGs),
training/metrics.py (metrics.jsonl, loss.png, TensorBoard), training/lm/measure.py (eval loss),
training/measure.py (sample, FLOPs) and training/lm/loop.py (the loop, on training/loop.py's BaseLoop).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from model.checkpoint import CheckpointError
from model.gpt import GPT
from training.checkpoints import LAST, load_resume, seed_or_restore_rngs
from training.config import ConfigError, TrainConfig, build_config
from training.distributed import setup_distributed
from training.errors import PROG, TrainError
from training.lm.build_model import build_model
from training.lm.data import DataDir, DataError, check_split_size, open_data_dir
from training.lm.loop import Loop
from training.loop import setup_precision
from training.metrics import summary_writer_class
from training.optim import lr_at, make_optimizer

__all__ = ["PROG", "TrainError", "build_parser", "lr_at", "main", "make_optimizer", "run", "train"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train the GPT of model/ on a directory written by python -m training.prepare. "
                    "Config precedence: defaults < --config file < --set overrides (with --resume, the saved "
                    "config replaces the defaults).",
        epilog="Config keys (with defaults): "
               + ", ".join(f"{k}={json.dumps(v)}" for k, v in TrainConfig().to_dict().items())
               + ". Outputs: OUT/last (with training_state.pt), OUT/best, OUT/metrics.jsonl, OUT/loss.png"
               " (and OUT/tensorboard with --tensorboard). "
               "Multi-process: torchrun --nproc_per_node N -m training.train ... "
               "Exit status: 0 on success, 2 on a user error, 130 when interrupted.")
    p.add_argument("--data", required=True, metavar="DIR", help="prepared data directory (train.bin, val.bin, "
                                                               "meta.json)")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory for checkpoints and logs")
    p.add_argument("--config", metavar="FILE", help="a .json or .toml file of TrainConfig keys")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set max_iters=500 --set dropout=0.2")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="continue exactly from OUT/last (optimizer, step, RNG)")
    g.add_argument("--init-from", metavar="CHECKPOINT",
                   help="start from an existing checkpoint's weights (fine-tuning; fresh optimizer); its tokenizer "
                        "must match the data's")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run even if OUT already holds one (its checkpoints are replaced)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or samples on the terminal")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to OUT/tensorboard (same as --set tensorboard=true; "
                        "needs pip install tensorboard)")
    return p


def run(args: argparse.Namespace) -> GPT:
    """Train; returns the trained model (this rank's copy, unwrapped)."""
    out = Path(args.out)
    if args.resume and args.init_from:
        raise TrainError("--resume and --init-from are exclusive")
    overrides = [*args.set, *(["tensorboard=true"] if getattr(args, "tensorboard", False) else [])]

    # ---- config (a resumed run starts from its saved config) ----
    state: dict[str, Any] | None = None
    if args.resume:
        state, cfg = load_resume(out, args.config, overrides)
    else:
        cfg = build_config(file=args.config, overrides=overrides)
        if (out / LAST).exists() and not args.overwrite:
            raise TrainError(f"{out} already holds a run ({out / LAST}); pass --resume to continue it, "
                             "--overwrite to start again, or choose another --out")
    if cfg.tensorboard:
        summary_writer_class()  # a missing tensorboard package is an error now, not after the model is built

    data = open_data_dir(args.data)
    return train(cfg, data, out, state=state, init_from=args.init_from, quiet=args.quiet)


def train(cfg: TrainConfig, data: DataDir, out: Path, state: dict[str, Any] | None = None,
          init_from: str | None = None, quiet: bool = False) -> GPT:
    """Train cfg's model on data into out (resuming from state, the training state of out/last, if given)."""
    d, device = setup_distributed(cfg.device)
    try:
        use_bf16 = setup_precision(cfg, device)
        model, cfg, init_meta = build_model(cfg, data, resume_from=out / LAST if state is not None else None,
                                            init_from=init_from)
        for split in ("train", "val"):
            check_split_size(data.split(split), cfg.block_size, split)
        model.to(device)
        optimizer = make_optimizer(model, cfg, device)
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
        seed_or_restore_rngs(state, cfg.seed, d.rank)
        model = Loop(cfg, data, out, model, optimizer, d, device, use_bf16, state, init_meta, quiet).run()
        d.finish()
        return model
    finally:
        d.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (TrainError, ConfigError, DataError, CheckpointError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
