"""``realign make-tiny OUT_DIR`` (also ``python -m realign.assets.tiny_cmd OUT_DIR``):
write the tiny tokenizer, models and arithmetic datasets of :mod:`realign.assets.tiny`,
and ``moe_actor/``, the tiny Qwen3-MoE policy of the MoE demo
(``experiments/demo-moe-sft.yaml``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from realign.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", help="folder to write the assets into (created if needed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the models and data split")
    p.add_argument("--max-operand", type=int, default=9, dest="max_operand",
                   help="largest operand of the a+b= task, 1..9 (4 is easier: 25 problems)")
    p.add_argument("--no-qwen2", dest="qwen2", action="store_false",
                   help="skip the Qwen2 policy variant")
    p.add_argument("--no-moe", dest="moe", action="store_false",
                   help="skip the Qwen3-MoE policy (moe_actor/)")


#: Seed offset of the MoE demo's actor (the other tiny models use offsets 0-4)
MOE_SEED_OFFSET = 5


def make_moe_actor(out_dir: str | Path, seed: int = 0) -> Path:
    """Write ``OUT_DIR/moe_actor``: a random Qwen3-MoE policy of
    :data:`realign.assets.tiny.TINY_QWEN3_MOE`'s shape (3 layers, the middle one dense,
    8 experts of 32, top 2) with the tiny tokenizer; a pure function of ``seed``."""
    from realign.assets.tiny import make_model

    return make_model(Path(out_dir) / "moe_actor", "qwen3_moe", "lm",
                      seed=seed + MOE_SEED_OFFSET)


def run(args: argparse.Namespace) -> int:
    from realign.assets.tiny import make_tiny_assets

    if not 1 <= args.max_operand <= 9:
        raise UserError(f"must be in 1..9, got {args.max_operand}", field="--max-operand")
    try:
        paths = make_tiny_assets(args.out_dir, seed=args.seed, qwen2=args.qwen2,
                                 max_operand=args.max_operand)
        if args.moe:
            paths["moe_actor"] = make_moe_actor(args.out_dir, seed=args.seed)
    except OSError as e:
        raise UserError(f"cannot write {args.out_dir}: {e.strerror or e}",
                        field="out_dir") from None
    width = max(len(k) for k in paths)
    for name, path in paths.items():
        print(f"{name:<{width}}  {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m realign.assets.tiny_cmd``): user errors are printed
    without a traceback, exit code 2."""
    parser = argparse.ArgumentParser(prog="python -m realign.assets.tiny_cmd",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
