"""Final reward (mean reward_mean over the last 5 steps) and padded tokens per step of
seeds.sh's runs, per mode and seed. Usage: python -m realign.bench.studies.packing_seeds_summary
OUT [RECORD.json]"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(out: Path, record: Path | None) -> None:
    res: dict[str, dict[str, dict]] = {"packed": {}, "padded": {}}
    for d in sorted(out.iterdir()):
        mode, _, seed = d.name.partition("-seed")
        if d.is_dir() and mode in res and seed.isdigit():
            rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()
                    if x.strip()]
            rows = [r for r in rows if "reward_mean" in r]
            res[mode][seed] = {
                "final_reward": statistics.mean(r["reward_mean"] for r in rows[-5:]),
                "padded_tokens": statistics.median(r["actor.padded_tokens"] for r in rows),
                "response_len": statistics.mean(r["response_len"] for r in rows),
                "steps": len(rows)}
    for mode, seeds in res.items():
        finals = [v["final_reward"] for v in seeds.values()]
        print(f"{mode}: final reward per seed {[round(f, 4) for f in finals]} mean "
              f"{statistics.mean(finals):.4f}; padded tokens per step (median) "
              f"{[v['padded_tokens'] for v in seeds.values()]}")
    if record is not None:
        record.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
