# Sourced by the interleaved studies of this folder: run_rounds ROUNDS OUT MODE...
# runs experiments/_bench_<mode>.yaml (name reason-sync-<mode>, run dir under OUT) once
# per mode in each round, in turn; keeps each run's metrics.jsonl and plan.json under
# OUT/<mode>-<round>/, its log as OUT/<mode>-<round>.log and the load after it in
# OUT/load.txt; removes the YAMLs at the end.
run_rounds() {
  local rounds=$1 out=$2; shift 2
  for r in $(seq 1 "$rounds"); do
    for mode in "$@"; do
      rm -rf "$out/reason-sync-$mode"
      .venv/bin/realign run "experiments/_bench_$mode.yaml" > "$out/$mode-$r.log" 2>&1
      mkdir -p "$out/$mode-$r" && cp "$out/reason-sync-$mode/"{metrics.jsonl,plan.json} "$out/$mode-$r/"
      uptime >> "$out/load.txt"
    done
  done
  for mode in "$@"; do rm -f "experiments/_bench_$mode.yaml"; done
}
