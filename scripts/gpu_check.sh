#!/usr/bin/env bash
# One short run on a CUDA machine that settles what the CPU cannot (issue 19); about 6-8 minutes
# on a cold H200, no network.
#
#   scripts/gpu_check.sh OUT_DIR                  # on the GPU machine, from the repo root
#   scripts/gpu_check.sh OUT_DIR --cpu-dry-run    # here: tiny shapes, CPU, Triton interpreted
#   scripts/gpu_check.sh --download-wheels DIR    # here, with pip access: what to bring
#
# What to bring. The GPU machine has torch, triton, transformers, safetensors, tokenizers,
# pyarrow, click, pyyaml, tqdm and pytest but not pydantic nor llguidance, and no network: bring
# their wheels (CPython 3.12, x86-64) in .whl/ at the repo root (or $BATCHGEN_WHEELS), made with
#   echo /.whl/ >> .git/info/exclude; scripts/gpu_check.sh --download-wheels .whl
# and carry that folder. They are installed with --no-index into a private folder.
#
# Steps (each one's status goes into OUT_DIR/summary.json; a failed step does not stop the rest;
# STEPS="kernels checks" runs only those):
#   1. tests: the GPU session (BATCHGEN_TEST_GPU=1): the kernel tests compiled, not interpreted,
#      plus the gpu-marked tests (fp32 exact and bf16 statistical parity through the CLI, int64
#      offsets, the CUDA sampler) -> pytest.log, pytest.xml
#   2. kernels: the kernels against the reference on real shapes (bf16, head_dim 128, GQA 4 and
#      7, block 16, contexts to 32k, mixed steps), timed, decode bandwidth as a share of a
#      measured device copy -> kernels.json
#   3. checks: engine greedy parity against transformers on CUDA (Llama-3-8B and Qwen2.5-7B
#      geometry, 2 layers, fp32 exact up to near ties, bf16 first divergences), KV sizing,
#      tokens/s against transformers generate on a workload like A, a short profile, the
#      Triton JIT caches -> checks.json
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEEL_PINS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
            typing-inspection==0.4.5 typing-extensions==4.16.0 llguidance==1.9.1)

if [[ "${1:-}" == "--download-wheels" ]]; then
    dest="${2:?usage: gpu_check.sh --download-wheels DIR}"
    platforms=()
    for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 \
             manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
        platforms+=(--platform "$p")
    done
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dest" "${WHEEL_PINS[@]}"
fi

OUT="${1:?usage: gpu_check.sh OUT_DIR [--cpu-dry-run]}"
DRY=0
[[ "${2:-}" == "--cpu-dry-run" ]] && DRY=1
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
declare -A STATUS

# A copy laid out as installed (kernels/ as batchgen/kernels), so nothing needs pip install.
WORK="$(mktemp -d /tmp/batchgen-gpu-check.XXXXXX)"
mkdir -p "$WORK/repo"
cp -r "$REPO/batchgen" "$REPO/tests" "$REPO/scripts" "$REPO/pyproject.toml" "$WORK/repo/"
cp -r "$REPO/kernels" "$WORK/repo/batchgen/kernels"
SITE="$WORK/site"
export PYTHONPATH="$WORK/repo"
if ! "$PY" -c "import pydantic, llguidance" 2>/dev/null; then
    WHEELS="${BATCHGEN_WHEELS:-$REPO/.whl}"
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "pydantic/llguidance missing and no wheels in $WHEELS: see the header of $0" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="$WORK/repo:$SITE"
fi
cd "$WORK/repo" || exit 2
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

STEPS="${STEPS:-tests kernels checks}"  # e.g. STEPS=checks for a rerun of one step

run_step() {  # name, log file (- for none), then the command
    local name="$1" log="$2"
    shift 2
    if [[ " $STEPS " != *" $name "* ]]; then
        STATUS[$name]="skipped"
        return
    fi
    local start=$SECONDS rc
    echo "=== $name: $*"
    if [[ "$log" == "-" ]]; then
        "$@"
        rc=$?
    else
        "$@" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    fi
    STATUS[$name]="rc=$rc seconds=$((SECONDS - start))"
    echo "=== $name: rc=$rc in $((SECONDS - start)) s"
}

if [[ $DRY == 1 ]]; then
    # The CPU session's view of the same steps: a few kernel tests, the smoke bench, tiny checks.
    run_step tests "$OUT/pytest.log" "$PY" -m pytest -q -p no:cacheprovider \
        -m "kernel and not slow" -k "choose_num_splits or per_step or store_kv" tests/ \
        --junitxml="$OUT/pytest.xml" -o addopts=""
    run_step kernels - "$PY" scripts/bench_kernels.py --smoke --json "$OUT/kernels.json"
    run_step checks - "$PY" scripts/gpu_check.py --out "$OUT" --cpu-dry-run
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    run_step tests "$OUT/pytest.log" env BATCHGEN_TEST_GPU=1 "$PY" -m pytest -q \
        -p no:cacheprovider -m "gpu or kernel" tests/ --junitxml="$OUT/pytest.xml" -o addopts=""
    run_step kernels - "$PY" scripts/bench_kernels.py --quick --json "$OUT/kernels.json"
    run_step checks - "$PY" scripts/gpu_check.py --out "$OUT"
fi

{
    echo "{"
    sep=""
    for name in tests kernels checks; do
        printf '%s  "%s": "%s"' "$sep" "$name" "${STATUS[$name]:-not run}"
        sep=$',\n'
    done
    printf '\n}\n'
} > "$OUT/summary.json"
cat "$OUT/summary.json"
rm -rf "$WORK"
grep -q 'rc=[1-9]' "$OUT/summary.json" && exit 1
exit 0
