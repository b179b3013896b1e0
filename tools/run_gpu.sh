#!/usr/bin/env bash
# The GPU run: every kernel test on the device, compute-sanitizer (memcheck and
# racecheck) over every kernel of every shipped config, then the benchmark
# table, printed last (with a PNG chart when matplotlib is installed).
# A grid of batches and contexts: TQGEN_BENCH_ARGS="--batch 1 8 32 64 128 --context 1024 4096 16384 65536".
# Usage (on a CUDA machine, from the repository root): bash tools/run_gpu.sh [OUT_DIR]
# TQGEN_GPU_STEPS picks steps (default "tests sanitize bench"; "tune" re-tunes TQGEN_TUNE_CONFIGS, default the
# configs whose committed tuned files for this GPU are stale (tools/stale_tuned.py), each for the query heads per KV
# head its file has (the planes files 1, 4, 8 and 16, the slots files 4; TQGEN_TUNE_GROUPS for all, and tqgen tune's
# default 1, 4, 8 and 16 for a config named that has no file); TQGEN_TUNE_BATCHES limits the batches;
# TQGEN_TUNE_SHORTLIST the launches a bucket re-times from the stale file (default 12; empty: every candidate);
# TQGEN_TUNE_SHORTLIST_FROM a folder of another GPU's tuned files to shortlist the buckets this GPU's files lack;
# docs/tuning.md), and packs
# the tuned files written so far, with the stale files set aside, into OUT_DIR/tuned.tar every 20 s (`tar -xf
# tuned.tar` in the checkout restores them; delete the NAME.json.replaced-TIME files before committing): a call
# that runs out of time keeps the buckets it finished, and after that `tar -xf` the next call resumes (the stale
# list has the config it was in, whose current file then tunes only the buckets it lacks, with the shortlists of
# the file set aside); "multi" times decode_multi
# at q_len 1-8 against decode, tools/bench_decode_multi.py, before the benchmark; "host" the host time of eager
# decode calls, tools/host_overhead.py, through triton's launch path and as shipped, into host.log; "merge" times
# stage 1 merging its own splits beside stage 2 at batch 1-8 (tools/ab_modules.py --merge-in-stage1, into
# merge.log; TQGEN_MERGE_CONFIGS, default k3v4 and k8v4 planes and k3v4 slots); "pending" times the pending kernels
# (plan.PENDING_KERNELS) beside the shipped ones, decode and decode_multi, into pending.log (TQGEN_AB_CONFIGS), and
# the store of TQGEN_AB_STORE_CONFIGS (default none) without, with and again without them (TQGEN_AB_CONFIGS set
# empty: the store's alone).
# TQGEN_TEST_SHARD=i/n runs the i-th of every n GPU tests (tests/conftest.py). TQGEN_PENDING_KERNELS=all runs every
# step on the kernels that wait for a re-tune (plan.PENDING_KERNELS): its tests, and its tune re-tunes the files they
# make stale (docs/tuning.md).
# TQGEN_SANITIZE_CONFIGS limits the sanitizers to some configs (default every shipped one, 8 sanitizer processes
# at a time); TQGEN_TEST_ARGS is passed to pytest as shell words (test files, -k "a or b"), TQGEN_BENCH_CONFIGS
# replaces the bench's eight shipped head_dim-128 configs.
# OUT_DIR gets these files, by step (the device tool returns no more than 8 from $OUT: every step at once writes 11):
# pytest-gpu.log, failures.log, tune.log, tuned.tar, sanitize.log (memcheck then racecheck), multi.log, host.log,
# merge.log, pending.log, bench.log, bench.json, bench.png.
set -u
# build_module CONFIG FOLDER: build CONFIG's module for this GPU into FOLDER and print its path.
build_module() {
    python3 -c "import sys; from tqgen import emit; print(emit.build(emit.as_config(sys.argv[1]), sys.argv[2]))" \
        "$1" "$2"
}
out=${1:-${OUT:-/tmp/tqgen-gpu}}
steps=${TQGEN_GPU_STEPS:-tests sanitize bench}
mkdir -p "$out"
# Modules are built outside OUT: the device tool returns only a few files from OUT,
# and a dozen generated modules there crowded out the logs and tuned files.
export PYTHONUNBUFFERED=1 TQGEN_CACHE_DIR="${TQGEN_CACHE_DIR:-/tmp/tqgen-gpu-modules}"
python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}')"
status=0
if [[ $steps == *tests* ]]; then
    # With pytest-xdist (the device image has it), 8 workers share the GPU: about 1650 tests, more than one call's
    # 600 s on an H100 (2026-12-05): TQGEN_TEST_SHARD=1/2, then 2/2, in two calls. Each failure is appended to
    # failures.log as it happens (tests/conftest.py), so a run stopped by the time limit still names them.
    workers=""; python3 -c "import xdist" 2>/dev/null && workers="-n 8"
    # TQGEN_TEST_ARGS as shell words, quotes kept (-k "slots or captured" is one argument), without eval.
    words='import os, shlex; print(end="".join(w + "\n" for w in shlex.split(os.environ.get("TQGEN_TEST_ARGS", ""))))'
    mapfile -t test_args < <(python3 -c "$words")
    rm -f "$out/failures.log"
    TQGEN_FAILURE_LOG="$out/failures.log" python3 -m pytest -m gpu -q -p no:cacheprovider $workers --durations=5 \
        "${test_args[@]}" 2>&1 | tee "$out/pytest-gpu.log" | tail -25
    rc=${PIPESTATUS[0]}; echo "gpu tests exit code: $rc"; (( rc )) && status=1
    [[ -s $out/failures.log ]] && { echo "failed:"; cut -c1-200 "$out/failures.log"; }
fi
if [[ $steps == *tune* ]]; then
    started=$(mktemp)  # outside OUT: the device tool returns few files
    # The capability names the arch of the GPU's files (stale_tuned.py knows only the H100's and H200's).
    read -r capability device < <(python3 -c \
        "import torch; print('%d.%d' % torch.cuda.get_device_capability(), torch.cuda.get_device_name())")
    # What this step wrote so far (the files it tuned, and the stale ones --force set aside, whose timings give a
    # resumed tune its shortlists), as one file; replaced whole, so a call cut off mid-write returns the last one.
    # -cnewer: a rename changes a file's ctime, not its mtime.
    pack_tuned() {
        local written
        written=$(find tuned \( -name '*.json' -o -name '*.json.replaced-*' \) -cnewer "$started")
        [[ -n $written ]] && tar -cf "$out/.tuned.tar.part" $written && mv -f "$out/.tuned.tar.part" "$out/tuned.tar"
    }
    # Lines of "CONFIG GROUP_SIZE...": the configs named, else those whose tuned files for this GPU are stale, each
    # with the group sizes its file was tuned for (tools/stale_tuned.py; a config named with no file has none).
    if [[ -n ${TQGEN_TUNE_CONFIGS:-} ]]; then
        plan=$(python3 tools/stale_tuned.py --device "$device" --capability "$capability" --include-current \
            $TQGEN_TUNE_CONFIGS) || { status=1; echo "tune: tools/stale_tuned.py failed on TQGEN_TUNE_CONFIGS"; }
    else
        # A failure (a tuned file it cannot read) comes after the configs it could list: those are still re-tuned.
        if plan=$(python3 tools/stale_tuned.py --device "$device" --capability "$capability"); then
            [[ -z $plan ]] && echo "tune: no committed tuned file for $device is stale (TQGEN_TUNE_CONFIGS names some)"
        else
            status=1; echo "tune: tools/stale_tuned.py failed (its error is in the output); re-tuning what it listed"
        fi
    fi
    shortlist=${TQGEN_TUNE_SHORTLIST-12}
    while read -r config groups; do
        [[ -z $config ]] && continue
        groups=${TQGEN_TUNE_GROUPS:-$groups}
        # The query rotated in stage 1 only, and stage 1's merge only up to 32 splits: in the H200 tables the other
        # rotation won 4 of 192 buckets, by at most 2.1%, and the merge no bucket above 32 splits; without them a
        # small-batch bucket times 40 candidates instead of 96. Each bucket times the 12 launches fastest in the
        # stale file and those it did not time (TQGEN_TUNE_SHORTLIST, empty for every candidate): in 949 buckets of
        # the committed files' successive tunes the best of the earlier 12 was at most 1.7% slower (docs/tuning.md).
        # --force only for a stale file (set aside, every bucket re-tuned); a current one, left by a call that ran
        # out of time, keeps its buckets and tunes those it lacks.
        # (A file stale_tuned.py cannot read is damaged: --force sets it aside too.)
        force=$(python3 tools/stale_tuned.py --device "$device" --capability "$capability" --stale-only "$config" \
            2>/dev/null) || force=damaged
        python3 -m tqgen.cli tune "$config" --warps 1 --stages 1 2 --block-kv 32 64 \
            --rotate-query stage1 --merge-max-splits 32 ${shortlist:+--shortlist $shortlist} \
            ${shortlist:+${TQGEN_TUNE_SHORTLIST_FROM:+--shortlist-from "$TQGEN_TUNE_SHORTLIST_FROM"}} \
            ${groups:+--group-size $groups} ${TQGEN_TUNE_BATCHES:+--batch $TQGEN_TUNE_BATCHES} \
            ${force:+--force} >> "$out/tune.log" 2>&1 < /dev/null &
        tuning=$!
        # A `timeout` ending this script ends the tune too, and packs what it saved.
        trap 'kill $tuning 2>/dev/null; pack_tuned; echo "tune: stopped in $config"; exit 1' TERM INT
        for (( seconds = 1; ; seconds++ )); do
            sleep 1; kill -0 $tuning 2>/dev/null || break
            (( seconds % 20 )) || pack_tuned
        done
        wait $tuning; rc=$?; trap - TERM INT
        tail -1 "$out/tune.log"; echo "tune $config exit code: $rc"; (( rc )) && status=1
        pack_tuned
    done <<< "$plan"
fi
if [[ $steps == *sanitize* ]]; then
    # One compute-sanitizer process per config and tool, 8 at a time (each is bound by its own host work, and a
    # config's kernels are small): all configs' memcheck and racecheck in a few minutes, where in turn they took
    # over one device call's 600 s. Each log is kept whole in sanitize.log, memcheck's first.
    configs=${TQGEN_SANITIZE_CONFIGS:-$(ls configs/*.yaml)}
    logs=$(mktemp -d)  # outside OUT: the device tool returns few files
    for tool in memcheck racecheck; do
        for config in $configs; do echo "$tool $config"; done
    done | xargs -P 8 -L 1 sh -c 'timeout 500 compute-sanitizer --tool "$0" --error-exitcode 1 \
        python3 tools/sanitize_kernels.py "$1" > "'"$logs"'/$0-$(basename "$1" .yaml).log" 2>&1; \
        echo "$0 $1 exit code: $?" >> "'"$logs"'/$0-$(basename "$1" .yaml).log"'
    : > "$out/sanitize.log"
    for tool in memcheck racecheck; do
        for config in $configs; do
            log="$logs/$tool-$(basename "$config" .yaml).log"
            cat "$log" >> "$out/sanitize.log"; tail -1 "$log"
            tail -1 "$log" | grep -q 'exit code: 0$' || status=1
        done
    done
fi
if [[ $steps == *multi* ]]; then
    python3 tools/bench_decode_multi.py configs/k8v4-d128-planes.yaml configs/k4v4-d128-planes.yaml \
        configs/k3v4-d128-planes.yaml configs/k3v3-d128-planes.yaml > "$out/multi.log" 2>&1
    rc=$?; grep '^|' "$out/multi.log"; echo "decode_multi bench exit code: $rc"; (( rc )) && status=1
fi
if [[ $steps == *merge* ]]; then
    for config in ${TQGEN_MERGE_CONFIGS:-configs/k3v4-d128-planes.yaml configs/k8v4-d128-planes.yaml \
                   configs/k3v4-d128.yaml}; do
        module=$(build_module "$config" "$TQGEN_CACHE_DIR")
        echo "$config" >> "$out/merge.log"
        python3 tools/ab_modules.py "$config" "$module" --merge-in-stage1 --launches 32:1:16 32:1:64 32:2:16 \
            --shapes 1x1024 1x4096 2x1024 4x1024 8x1024 1x16384 >> "$out/merge.log" 2>&1
        rc=$?; echo "merge A/B $config exit code: $rc"; (( rc )) && status=1
    done
    grep -E '^\||^configs' "$out/merge.log"
fi
if [[ $steps == *host* ]]; then
    # triton's launch path on every launch first (TQGEN_FAST_LAUNCH=0), then as shipped: both in one session
    { echo "TQGEN_FAST_LAUNCH=0"; TQGEN_FAST_LAUNCH=0 python3 tools/host_overhead.py --shapes 1x4096 8x4096; \
      echo "as shipped"; python3 tools/host_overhead.py --shapes 1x4096 8x4096; } > "$out/host.log" 2>&1
    rc=$?; grep -E '^\||^TQGEN|^as shipped' "$out/host.log"; echo "host overhead exit code: $rc"; (( rc )) && status=1
fi
if [[ $steps == *pending* ]]; then
    # The pending kernels (plan.PENDING_KERNELS) against the shipped ones, before any re-tune: each config of
    # TQGEN_AB_CONFIGS rendered without and with TQGEN_PENDING_KERNELS=all, then decode timed side by side at pinned
    # launches (the pending module's tuned files are stale, so it would take the heuristic's) with
    # tools/ab_modules.py, at batch 1-8 (the query rotated in stage 1) and at 8-32 x 8192, and decode_multi at q_len
    # 1 and 4 with tools/bench_decode_multi.py (planes configs). Into pending.log.
    ab_configs=${TQGEN_AB_CONFIGS-configs/k3v4-d128-planes.yaml configs/k4v4-d128-planes.yaml configs/k3v4-d128.yaml}
    for config in $ab_configs; do
        modules=()
        for pending in "" all; do  # each copied to a name that says which it is (ab_modules labels by file name)
            built=$(TQGEN_PENDING_KERNELS=$pending build_module "$config" "$TQGEN_CACHE_DIR/pending-${pending:-none}")
            module="$TQGEN_CACHE_DIR/${pending:+pending-}${pending:-shipped}-$(basename "$config" .yaml).py"
            cp "$built" "$module" && modules+=("$module")
        done
        echo "$config: ${modules[*]}" >> "$out/pending.log"
        python3 tools/ab_modules.py "$config" "${modules[@]}" --shapes 1x4096 2x4096 8x1024 \
            --launches 32:1:64 32:2:64 32:2:16 --rotate-query stage1 >> "$out/pending.log" 2>&1
        small=$?
        python3 tools/ab_modules.py "$config" "${modules[@]}" --shapes 32x8192 8x8192 \
            --launches 32:1:8 32:2:4 32:2:16 >> "$out/pending.log" 2>&1
        large=$?; (( small || large )) && { status=1; echo "pending A/B $config failed"; }
        if [[ $config == *planes* ]]; then
            python3 tools/bench_decode_multi.py "$config:${modules[0]}" "$config:${modules[1]}" --shapes 32x8192 \
                --q-lens 1 4 >> "$out/pending.log" 2>&1 || { status=1; echo "pending decode_multi $config failed"; }
        fi
    done
    # A pending store kernel (no tuned file; docs/kernels.md): the store of TQGEN_AB_STORE_CONFIGS (default none) at
    # 4096 and 65536 tokens without, with and again without every pending kernel (one tqgen bench each: the variable
    # is read when the modules render).
    if [[ -n ${TQGEN_AB_STORE_CONFIGS:-} ]]; then
        for pending in "" all ""; do
            echo "store, TQGEN_PENDING_KERNELS=$pending" >> "$out/pending.log"
            TQGEN_PENDING_KERNELS=$pending python3 -m tqgen.cli bench $TQGEN_AB_STORE_CONFIGS --ops store \
                --store-tokens 4096 65536 >> "$out/pending.log" 2>&1 || { status=1; echo "pending store A/B failed"; }
        done
    fi
    grep -E '^\||^configs|^store' "$out/pending.log"
fi
if [[ $steps == *bench* ]]; then
    bench_args=${TQGEN_BENCH_ARGS:-}
    chart=""  # the chart draws decode rows: only when matplotlib is there and decode is timed
    if python3 -c "import matplotlib" 2>/dev/null && { [[ $bench_args != *--ops* ]] || [[ $bench_args == *decode* ]]; }; then
        chart="--chart $out/bench.png"
    fi
    python3 -m tqgen.cli bench ${TQGEN_BENCH_CONFIGS:-configs/k8v4-d128.yaml configs/k4v4-d128.yaml \
        configs/k3v4-d128.yaml configs/k3v3-d128.yaml configs/k8v4-d128-planes.yaml configs/k4v4-d128-planes.yaml \
        configs/k3v4-d128-planes.yaml configs/k3v3-d128-planes.yaml} --json "$out/bench.json" $chart $bench_args 2>&1 \
        | tee "$out/bench.log" | grep -v '^\['
    rc=${PIPESTATUS[0]}; echo "bench exit code: $rc"; (( rc )) && status=1
fi
exit "$status"
