#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run: the GPU-marked tests, the served families
# and structured outputs with the engine on CUDA (xgrammar's CUDA bitmask path), bf16 MoE,
# `flatserve bench` on the tiny model and the 3B-shaped preset, and the 2048px soak.
#
#     OUT=out/gpu bash scripts/gpu_checks.sh [steps...]
#
# Steps (default: all, in this order): env tests e2e moe bench bench3b soak; and, asked for
# by name, kernels (the Triton paged decode kernel against the eager path, one layer) and
# bench35 (the qwen3.5-0.8b preset's rows: text c=1/32/128, 448px c=32; bench3b has the 3b
# preset's: text c=1/32/128, 1024px c=32, 448px c=64; both on one server each with
# BENCH_ARGS, default --no-enforce-eager) and graphs (the
# 3b and qwen3.5 text rows at c=1 and c=32, --no-enforce-eager beside --enforce-eager in
# one table with ratios, GRAPH_MODELS picks the presets; then mixed lengths at c=64, steps
# with prompt chunks in pieces beside eager, MIXED_MODELS ("3b")) and soak35 (the seeds' workload:
# qwen3.5-0.8b, 1024px, c=128, 10% disconnects).
# Everything is logged to $OUT/log.txt (bench tables too); the soak's CSV, PNG and summary
# land in $OUT/soak.
# Without flatserve installed (a bare GPU machine) it runs from the checkout: wheels in
# ./.whl (if present: scripts/gpu_wheels.sh fills it; carry it) are installed into /tmp/site
# first. Environment knobs:
# SOAK_REQUESTS (2000), SOAK_CONCURRENCY (128), SOAK_SIZE (2048), BENCH_REQUESTS (200),
# GRAPH_MODELS ("3b qwen3.5-0.8b"), MIXED_MODELS ("3b"), GRAPHS_LIMIT (480 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ -d .whl ] && ! "$PY" -c "import zmq, fastapi, xgrammar, av, fla" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
FS="$PY -m flatserve.cli"
PORT=${PORT:-8011}
export PY FS OUT LOG PORT

step() {  # step NAME LIMIT_S command...: run, log, print one summary line
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "===== $name: $*" >>"$LOG"
    timeout -k 10 "$limit" bash -c "$*" >>"$LOG" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt" >>"$LOG"
    return $rc
}

model() { $FS make-model --preset "$1" 2>>"$LOG" | tail -1; }

busy() {  # busy NAME command...: run it while nvidia-smi samples the GPU's utilization
    # every 0.5 s; print the samples' median and the share at >= 80% (the GPU issues' target)
    local name=$1 pid rc
    shift
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 \
        >"$OUT/busy_$name.txt" 2>/dev/null &
    pid=$!
    "$@"
    rc=$?
    kill "$pid" 2>/dev/null
    "$PY" - "$OUT/busy_$name.txt" "$name" <<'PYEOF'
import statistics, sys
samples = [int(x) for x in open(sys.argv[1]).read().split() if x.strip().isdigit()]
if samples:
    busy = sum(s >= 80 for s in samples) / len(samples)
    print(f"GPU busy {sys.argv[2]}: median {statistics.median(samples)}%, "
          f">= 80% in {busy:.0%} of {len(samples)} samples")
PYEOF
    return $rc
}

run_env() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch; from importlib.metadata import version as v; print('torch', \
torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', \
v('transformers'), 'xgrammar', v('xgrammar'))"
    nproc
}

run_tests() {  # the GPU-marked tests, then the Triton kernels' tests on the card
    "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine_proc
    "$PY" -m pytest -q -p no:cacheprovider tests/engine_proc/test_kernel_probes.py \
        tests/engine_proc/test_gated_delta_rule_triton.py \
        tests/engine_proc/test_gated_delta_rule_fla.py \
        tests/engine_proc/test_paged_decode_attention_triton.py \
        tests/engine_proc/test_norm_rotary_triton.py
}

run_e2e() {  # every family served with its engine on CUDA, against transformers' tokens
    "$PY" -m pytest -q -p no:cacheprovider tests/e2e/test_family_parity.py \
        tests/e2e/test_structured_outputs.py tests/e2e/test_openai_parity.py
}

run_moe() {  # Qwen3-VL MoE and Qwen3.5-MoE served in bfloat16 (grouped GEMMs), image + text
    local m
    for m in tiny-qwen3-vl-moe tiny-qwen3.5-moe; do
        $FS bench --workload mixed --image-size 448 --concurrency 16 --num-requests 64 \
            --output-len 32 --ignore-eos --no-progress \
            -- --model "$(model $m)" --dtype bfloat16
    done
}

run_bench() {  # the README's rows on the tiny model
    local n=${BENCH_REQUESTS:-200}
    $FS bench --workload text --prompt-len 100 --output-len 64 --ignore-eos \
        --concurrency 32 --num-requests "$n" --no-progress
    $FS bench --workload image --image-size 1024 --output-len 32 --ignore-eos \
        --concurrency 32 --num-requests "$n" --no-progress
}

serve_bg() {  # serve_bg NAME args...: a server in the background on $PORT for the rows
    # after it (bench --base-url: one start for a preset's rows); stop_bg stops it
    $FS serve --port "$PORT" "${@:2}" >"$OUT/server_$1.log" 2>&1 &
    SERVER_PID=$!
    "$PY" - "$PORT" "$SERVER_PID" <<'PYEOF' || { stop_bg; return 1; }
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(1200):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        os.kill(pid, 0)  # healthy, and this server (not another one holding the port)
        sys.exit(0)
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("the server exited before it was healthy")
        time.sleep(0.5)
sys.exit("the server was not healthy in 600 s")
PYEOF
}

stop_bg() { kill -INT "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; true; }

rows() {  # rows PRESET: the GPU issues' rows on one server with graphs (BENCH_ARGS, default
    # --no-enforce-eager): text 256 words / 128 tokens at c=1, 32, 128 (GPU busy sampled),
    # then the preset's image rows (IMAGE_ROWS: "size:concurrency ...")
    local p=$1 c size rc=0
    serve_bg "rows_$p" --model "$(model "$p")" --max-num-seqs 128 \
        ${BENCH_ARGS---no-enforce-eager} || return 1
    for c in 1 32 128; do
        busy "${p}_text_c$c" $FS bench --base-url "http://127.0.0.1:$PORT" --workload text \
            --prompt-len 256 --output-len 128 --ignore-eos --concurrency "$c" \
            --num-requests $(( c < 32 ? 8 : 2 * c )) --no-progress --label "$p text c=$c" \
            || rc=$?
    done
    for size in $IMAGE_ROWS; do
        c=${size#*:}
        $FS bench --base-url "http://127.0.0.1:$PORT" --workload image \
            --image-size "${size%:*}" --output-len 64 --ignore-eos --concurrency "$c" \
            --num-requests $(( 3 * c )) --no-progress --label "$p ${size%:*}px c=$c" || rc=$?
    done
    stop_bg
    grep -h "replayed decode graphs" "$OUT/server_rows_$p.log" || true
    return $rc
}

run_bench3b() {  # Qwen2.5-VL-3B shapes, random bf16 weights: the GPU engine issue's rows
    IMAGE_ROWS="1024:32 448:64" rows 3b
}

run_bench35() {  # Qwen3.5-0.8B shapes, random bf16 weights (the Qwen3.5-on-GPU issue's rows)
    IMAGE_ROWS="448:32" rows qwen3.5-0.8b
}

run_soak35() {  # the seeds' workload: Qwen3.5-0.8B, 1024px, c=128, 10% disconnects
    $FS soak --requests "${SOAK_REQUESTS:-2000}" --concurrency 128 --image-size 1024 \
        --max-tokens 32 --disconnect-share 0.1 --out "$OUT/soak35" \
        -- --model "$(model qwen3.5-0.8b)" --max-num-seqs 128
}

run_graphs() {  # decode steps as CUDA graphs beside eager (--baseline-args), same sitting,
    # ratios printed; the graphs-vs-eager tokens test ran in `tests`
    local p m c
    for p in ${GRAPH_MODELS:-3b qwen3.5-0.8b}; do
        m=$(model "$p")
        for c in 1 32; do
            $FS bench --workload text --prompt-len 256 --output-len 128 --ignore-eos \
                --concurrency "$c" --num-requests $(( c < 32 ? 6 : 64 )) --no-progress \
                --label "$p graphs c=$c" --baseline-args=--enforce-eager \
                --server-log "$OUT/server_graphs_${p}_c$c.log" \
                -- --model "$m" --no-enforce-eager
        done
    done
    # staggered mixed lengths: half the steps carry a prompt chunk; pieces beside decode
    # graphs alone (--cudagraph-mode full_decode_only)
    for p in ${MIXED_MODELS:-3b}; do
        $FS bench --workload text --prompt-len 256 --prompt-len-range 0.5 --output-len 128 \
            --output-len-range 0.5 --ignore-eos --concurrency 64 --num-requests 192 \
            --no-progress --label "$p pieces, mixed lengths c=64" \
            --baseline-args=--cudagraph-mode=full_decode_only \
            --server-log "$OUT/server_graphs_${p}_mixed.log" \
            -- --model "$(model "$p")" --no-enforce-eager
    done
    grep -h "replayed decode graphs" "$OUT"/server_graphs_*.log || true  # their share
}

run_soak() {  # 2048px, unique images, 10% disconnects
    $FS soak --requests "${SOAK_REQUESTS:-2000}" \
        --concurrency "${SOAK_CONCURRENCY:-128}" --image-size "${SOAK_SIZE:-2048}" \
        --max-tokens 32 --disconnect-share 0.1 --out "$OUT/soak" \
        -- --max-num-seqs "${SOAK_CONCURRENCY:-128}"
}

run_kernels() {  # Qwen2.5-VL-3B's and Qwen3.5-0.8B's attention shapes, bf16
    "$PY" scripts/bench_paged_decode.py --json "$OUT/paged_decode_3b.json"
    "$PY" scripts/bench_paged_decode.py --heads 8 --kv-heads 2 --head-dim 256 --splits 8 \
        --json "$OUT/paged_decode_0_8b.json"
}

export -f model busy serve_bg stop_bg rows run_env run_tests run_e2e run_moe run_bench run_bench3b run_bench35 run_soak \
    run_kernels run_graphs run_soak35
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests e2e moe bench bench3b soak)
declare -A LIMIT=([env]=60 [tests]=180 [e2e]=300 [moe]=60 [bench]=80 [bench3b]=300
                  [soak]=260 [kernels]=90 [bench35]=240
                  [graphs]=${GRAPHS_LIMIT:-480} [soak35]=400)
for s in "${steps[@]}"; do
    step "$s" "${LIMIT[$s]}" "run_$s"
done
cat "$OUT/summary.txt"
