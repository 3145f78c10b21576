#!/usr/bin/env bash
# `make gpu-check`: the GPU test set and the GPU benchmarks on one GPU, each part under its own time
# limit, everything written to files in OUT (a GPU box is lent for minutes; a stuck part must not
# eat the rest, and the evidence must survive the session being cut off):
#   OUT/tests.log        pytest -m gpu
#   OUT/bench.log        the benchmarks' output
#   OUT/res/*.json       one record per benchmark; OUT/res/summary.md the tables;
#                        OUT/res/learner_profile.txt the learner step's top operators
# Exit status: non-zero when any part failed or hit its limit.
#   GPU_PYTHON=python3 GPU_OUT=gpu-results TEST_S=300 BENCH_S=150 ENGINE_ARGS="..." tools/gpu_check.sh
# A part's own limit, <PART>_S (TRAINER_S, LOGPROB_S, LEARNER_S, SYNC_S, ENGINE_S), overrides BENCH_S, so one
# lease can give the engine's long greedy run more time than the quick parts.
set -uo pipefail
PY=${GPU_PYTHON:-python3}
OUT=${GPU_OUT:-gpu-results}
TEST_S=${TEST_S:-300}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-150}
BENCH_S=${BENCH_S:-150}
# The engine benchmark's shapes (its defaults, 64 x 512 greedy, take minutes on one GPU).
ENGINE_ARGS=${ENGINE_ARGS:---batch 32 --gen 128 --rl-prompts 4 --group 8 --repeats 1 --compression-batch 16 --compression-gen 128}
read -ra engine_args <<<"$ENGINE_ARGS"
TRAINER_ARGS=${TRAINER_ARGS:---steps 5}
read -ra trainer_args <<<"$TRAINER_ARGS"
RES="$OUT/res"
mkdir -p "$RES"
export PYTHONUNBUFFERED=1

part() {  # part NAME LIMIT_S CMD...: timeout signals its whole process group (torchrun's workers too)
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "[gpu-check] $name: exit $rc after $((SECONDS - start)) s (limit $limit s)"
    return $rc
}

{
    failed=()
    # One part at a time: on a shared GPU the first lease's tests and benchmarks slowed each other
    # past their limits. pytest-timeout fails a stuck test with its traceback instead; -v logs each
    # test as it ends, so a part cut at its limit still says which passed.
    part tests "$TEST_S" "$PY" -m pytest -v -m gpu tests -p no:cacheprovider -rfE --durations=15 \
        --timeout="$TEST_TIMEOUT_S" >"$OUT/tests.log" 2>&1 || failed+=(tests)
    part trainer "${TRAINER_S:-$BENCH_S}" "$PY" -m benchmarks.gpu.trainer --out "$RES" "${trainer_args[@]}" ||
        failed+=(trainer)
    part logprob "${LOGPROB_S:-$BENCH_S}" "$PY" -m benchmarks.gpu.logprob --out "$RES" || failed+=(logprob)
    part learner "${LEARNER_S:-$BENCH_S}" "$PY" -m benchmarks.gpu.learner --out "$RES" --profile || failed+=(learner)
    part sync "${SYNC_S:-$BENCH_S}" "$PY" -m benchmarks.gpu.sync --out "$RES" || failed+=(sync)
    part engine "${ENGINE_S:-$BENCH_S}" "$PY" -m benchmarks.gpu.engine --out "$RES" "${engine_args[@]}" ||
        failed+=(engine)
    "$PY" -m benchmarks.gpu --out "$RES" --summary-only
    tail -n 25 "$OUT/tests.log"
    if ((${#failed[@]})); then
        echo "[gpu-check] FAILED: ${failed[*]}"
        exit 1
    fi
    echo "[gpu-check] all parts passed"
} 2>&1 | tee "$OUT/bench.log"
