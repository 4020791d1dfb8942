"""Quantize a checkpoint once and save it: `python -m model.quantize --checkpoint DIR --out DIR --mode int8|int4`.

The result is still a checkpoint directory that `load_checkpoint` and the server load like any other; it is smaller
on disk and loads without the fp32 weights ever being in memory. Its format: model/quantized_format.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import save_file

from model.checkpoint import TIED, WEIGHTS, CheckpointError, load_checkpoint
from model.linear import DEFAULT_INT4_GROUP, INT4_GROUPS, FormatError, block_linears
from model.quantized_format import QUANTIZATION, quantize_state, read_quantization


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="an fp32/bf16 checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR", help="where the quantized checkpoint goes (must not exist)")
    p.add_argument("--mode", required=True, choices=("int8", "int4"))
    p.add_argument("--group-size", type=int, default=DEFAULT_INT4_GROUP, choices=INT4_GROUPS,
                   help=f"int4: inputs sharing a scale and zero point (default {DEFAULT_INT4_GROUP})")
    args = p.parse_args(argv)
    prog = "python -m model.quantize"
    src, out = Path(args.checkpoint), Path(args.out)
    tmp = out.parent / f".{out.name}.tmp"
    try:
        if out.exists():
            raise FileExistsError(f"--out {out} already exists")
        if read_quantization(src) is not None:
            raise CheckpointError(f"{src / QUANTIZATION}: already quantized; quantize its fp32 source instead")
        ck = load_checkpoint(src)  # every check a server makes: files, shapes, finite values
        names = [n for n, *_ in block_linears(ck.model)]
        state = {k: v.float() if v.is_floating_point() else v for k, v in ck.model.state_dict().items() if k != TIED}
        qstate = quantize_state(state, names, args.mode, args.group_size)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(WEIGHTS, "training_state.pt"))
        save_file(qstate, str(tmp / WEIGHTS), metadata={"format": "pt"})
        q = {"mode": args.mode, "group_size": args.group_size if args.mode == "int4" else None}
        (tmp / QUANTIZATION).write_text(json.dumps(q, indent=2) + "\n")
        meta = dict(ck.metadata, quantized_from=str(src), quantization=q)
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
        tmp.rename(out)
    except (CheckpointError, FormatError, FileExistsError, ValueError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    size = (out / WEIGHTS).stat().st_size
    print(f"{out}: {args.mode} weights, {size / 1e6:.1f} MB (from {(src / WEIGHTS).stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
