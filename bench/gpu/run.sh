#!/usr/bin/env bash
# The GPU check (issue 5): kernel tests on CUDA, paged-decode bandwidth, the 4-bit AWQ/GPTQ
# dequantize-matmul (correctness and speed vs bf16, section quant_matmul), the LoRA shrink/expand kernels
# (correctness and time vs a torch gather-bmm, section lora), whole-engine decode tokens/s,
# and the same decode at tensor_parallel_size=2 (section tp2_decode; `skipped` with fewer than 2 GPUs).
# Installs nothing: needs python with torch, triton and transformers. Writes $OUT/gpu.json.
#   bench/gpu/run.sh                 # on the GPU machine (about 3-5 minutes on an H200)
#   DRY_RUN=1 bench/gpu/run.sh       # CPU, Triton interpreter, tiny sizes: checks the script itself
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export OUT="${OUT:-$(mktemp -d -t specfleet-gpu-XXXXXX)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
# Every python below starts in the repository root: without the root on sys.path, where ./kernels would shadow
# the kernels package transformers imports (engine/python_child.py). An environment variable, not -P, so that
# an interpreter older than 3.11 still starts.
export PYTHONSAFEPATH=1
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  export TRITON_INTERPRET=1
fi

# Not installed there: expose the repo folders as the `specfleet` namespace package through symlinks.
if ! "$PY" -c "import specfleet.kernels, specfleet.engine, specfleet.bench" 2>/dev/null; then
  SHIM="$(mktemp -d -t specfleet-shim-XXXXXX)"
  mkdir -p "$SHIM/specfleet"
  for pkg in engine kernels bench operator; do
    ln -s "$REPO/$pkg" "$SHIM/specfleet/$pkg"
  done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi

cd "$REPO"
# Hard cap below the 8-minute budget: gpu.json is rewritten after every section, so a cut run keeps data.
timeout --signal=INT 450 "$PY" -u -m specfleet.bench.gpu.gpu_check 2>&1 | tee "$OUT/gpu.log"
status=${PIPESTATUS[0]}
if [[ ! -s "$OUT/gpu.json" ]]; then
  printf '{"errors": {"run.sh": "gpu_check.py exited %s before writing gpu.json"}}\n' "$status" > "$OUT/gpu.json"
fi
echo "gpu.json at $OUT/gpu.json (exit $status)"
exit "$status"
