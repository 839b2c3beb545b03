"""``realign profile [--device cpu|cuda] [--out FILE]``: measure this machine's rates and
realign's engines, and write the profile table that ``plan.profile`` and ``realign plan
--profile FILE`` price with (:mod:`realign.profile.run`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from realign.profile.passes import DEFAULT_PASSES

DEFAULT_OUT = "profile.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="what to measure (default cpu)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"table to write (default {DEFAULT_OUT})")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes, one per device (default: every CPU core / GPU)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per worker, as the runs' launcher.threads_per_worker "
                        "(default 1)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="parameter dtype the runs use (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--preset", default=None,
                   help="device preset the table is for (default: cpu, or guessed from the GPU)")
    p.add_argument("--passes", type=int, default=None,
                   help="passes over the GEMM grid and the engine probes, each probe's "
                        "samples pooled over them: a machine whose speed moves from minute "
                        f"to minute is measured at its typical speed (default {DEFAULT_PASSES})")


def run(args: argparse.Namespace) -> int:
    from planner.specs.cluster import device_presets
    from realign.errors import UserError
    from realign.profile.passes import SPEED_WARN, speed_moved
    from realign.profile.run import default_settings, profile_machine
    from realign.run.checkpoint import save_file

    if args.workers is not None and args.workers < 1:
        raise UserError(f"must be >= 1, got {args.workers}", field="--workers")
    if args.threads < 1:
        raise UserError(f"must be >= 1, got {args.threads}", field="--threads")
    if args.passes is not None and args.passes < 1:
        raise UserError(f"must be >= 1, got {args.passes}", field="--passes")
    if args.preset is not None and args.preset not in device_presets():
        raise UserError(f"unknown preset {args.preset!r}; allowed: "
                        f"{', '.join(sorted(device_presets()))}", field="--preset")
    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"{out} is a folder; give a file name", field="--out")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UserError("torch sees no CUDA device here; profile with --device cpu",
                            field="--device")
    settings = default_settings(args.device, args.workers, args.threads, args.dtype,
                                args.preset, args.passes or DEFAULT_PASSES)
    table = profile_machine(settings)
    try:
        save_file(table.model_dump_json(indent=1).encode(), out)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}", field="--out") from None
    rms = ", ".join(f"{k} {v:.0%}" for k, v in table.measured.fit_rms_relative_error.items())
    print(f"profile of {settings.workers} {settings.device} worker(s) written to {out} in "
          f"{table.measured.duration_s:.0f} s (engine fits, RMS relative error: {rms})")
    ratios = table.measured.pass_time_ratios
    if len(ratios) > 1:
        moved = speed_moved(list(ratios))
        print(f"the machine's speed over the {len(ratios)} passes: "
              f"{', '.join(f'{r:.2f}x' for r in ratios)} of the typical time"
              + (f": it moved by {moved:.0%} while measured (other work on it, or on the "
                 "host of a virtual machine); estimates priced with this table carry "
                 "that uncertainty, and a profile taken again may differ by as much"
                 if moved > SPEED_WARN else ""))
    return 0
