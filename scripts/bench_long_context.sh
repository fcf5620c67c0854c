#!/usr/bin/env bash
# Long prompts beside chats (docs/benchmarks.md): 64 chats alone, then the same chats while 4
# requests with ~32k-token prompts run, through a launched engine at its defaults.
# Usage: scripts/bench_long_context.sh MODEL OUT_DIR [LONG_WORDS] [extra launch options...]
set -euo pipefail
model=$1 out=$2 words=${3:-30000}
shift $(( $# < 3 ? $# : 3 ))
py=${PYTHON:-python3}
mkdir -p "$out"
"$py" -m mlx_engine.cli launch --model "$model" --port 30600 --zmq-port 30601 "$@" >"$out/launch.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
until "$py" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:30600/health', timeout=2)" 2>/dev/null; do
    kill -0 $pid || { cat "$out/launch.log"; exit 1; }
    sleep 1
done
bench() { "$py" -m mlx_engine.cli bench --url http://127.0.0.1:30600 --no-progress "$@"; }
chats=(--concurrency 64 --num-requests 192 --input-len 128:512 --output-len 128)
bench "${chats[@]}" --out "$out/chats_alone" | tail -4
bench --concurrency 4 --num-requests 4 --input-len "$words" --output-len 64 --out "$out/long" \
    >"$out/long.txt" &
long=$!
sleep 1
bench "${chats[@]}" --seed 1 --out "$out/chats_beside_long" | tail -4
wait $long
tail -4 "$out/long.txt"
