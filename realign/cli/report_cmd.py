"""``realign report RUN_DIR [--out report.html]``: one self-contained HTML page of a
run (learning curves, measured against planned times, timelines, reallocations),
pictures inline; opens without network."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run folder (realign run / submit)")
    p.add_argument("--out", help="where to write the page (default: RUN_DIR/report.html)")


def run(args: argparse.Namespace) -> int:
    from realign.errors import UserError
    from realign.report.page import build_report
    from realign.run.checkpoint import save_file

    page = build_report(Path(args.run_dir))
    out = Path(args.out) if args.out else Path(args.run_dir) / "report.html"
    try:
        save_file(page.encode(), out)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}", field="--out") from None
    print(f"report written to {out}")
    return 0
