#!/usr/bin/env bash
# Profile decode stage 1 with Nsight Compute (full set) at one shape, one report per config, and
# export the raw metrics and the per-instruction SASS stall samples as CSV beside each report.
# Usage (GPU machine, repository root): bash tools/ncu_stage1.sh OUT_DIR 32x16384 configs/k3v4-d128-planes.yaml ...
# TQGEN_PROFILE_ARGS passes options to tools/profile_decode.py (--variant, --block-kv, --stages, --splits) and
# TQGEN_PROFILE_NAME suffixes the report names, TQGEN_NCU_REPORTS puts the .ncu-rep files elsewhere (default
# OUT_DIR; the CSVs stay there), TQGEN_NCU_KERNEL the kernels profiled (a regex; default tq_decode_stage1; decode_multi's
# warpgroup kernel: tq_decode_multi_stage1_wg, with --q-len in TQGEN_PROFILE_ARGS). tools/ncu_summary.py OUT_DIR/NAME
# prints the pipe, issue and stall table of each.
set -u
out=$1; shape=$2; shift 2
reports=${TQGEN_NCU_REPORTS:-$out}  # where the .ncu-rep files go (the CSVs go to OUT_DIR)
mkdir -p "$out" "$reports"
export PYTHONUNBUFFERED=1 TQGEN_CACHE_DIR="${TQGEN_CACHE_DIR:-/tmp/tqgen-ncu-modules}"
for config in "$@"; do
    name=$(basename "$config" .yaml)${TQGEN_PROFILE_NAME:-}
    ncu --clock-control none -k "regex:${TQGEN_NCU_KERNEL:-tq_decode_stage1}" -s 2 -c 1 --set full --import-source no \
        -f -o "$reports/$name" python3 tools/profile_decode.py "$shape" "$config" ${TQGEN_PROFILE_ARGS:-} > "$out/$name.log" 2>&1
    echo "ncu $config exit code: $?"; tail -2 "$out/$name.log"
    ncu -i "$reports/$name.ncu-rep" --page raw --csv > "$out/$name.raw.csv" 2>>"$out/$name.log"
    ncu -i "$reports/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.sass.csv" 2>>"$out/$name.log" \
        || echo "source page export failed (see $name.log)"
done
