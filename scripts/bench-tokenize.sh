#!/usr/bin/env bash
# Tokenizing throughput on a generated corpus of zstd JSON lines, against the anchor: the
# `tokenizers` library's own Python encode_batch on the same documents (the same Rust library
# without spes's reading, decompressing, writing and bookkeeping).
#
#   scripts/bench-tokenize.sh [MB] [path/to/spes]     (default 1024 MB, target/release/spes)
#
# Generates WORK/corpus once (scripts/bench_tokenize.py make, from ../shared's texts), then
# runs spes tokenize with 1 and 2 threads under /usr/bin/time (peak RSS) and the anchor, and
# prints a Markdown table. WORK is $BENCH_DIR or /tmp/spes-bench-tokenize.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mb="${1:-1024}"
spes="${2:-$root/target/release/spes}"
py="${PYTHON:-$root/.venv/bin/python}"
work="${BENCH_DIR:-/tmp/spes-bench-tokenize}"
shared="$root/../shared"
tokenizer="$shared/tokenizers/gpt-neox-olmo-dolma-v1_5.json"
corpus="$work/corpus-$mb"
mkdir -p "$work"
if [ ! -f "$corpus/done" ]; then
  rm -rf "$corpus"
  "$py" "$root/scripts/bench_tokenize.py" make --out "$corpus" --mb "$mb" --files 16 \
    --texts "$shared/data/tinyshakespeare.txt" "$shared/data/wikitext-2/valid.txt"
  for f in "$corpus"/*.jsonl; do zstd -q -3 --rm "$f"; done
  touch "$corpus/done"
fi
text_mb=$(du -sm --apparent-size "$corpus" | cut -f1)

run_spes() {  # threads -> "tokens_per_s mb_per_s seconds rss_mb"
  local out="$work/out-$1"
  rm -rf "$out"
  /usr/bin/time -v "$spes" tokenize --input "$corpus" --out "$out" --tokenizer "$tokenizer" \
    --threads "$1" >"$work/spes-$1.log" 2>"$work/spes-$1.time"
  local line rss
  line=$(grep 'tokens/s' "$work/spes-$1.log")
  rss=$(awk '/Maximum resident set size/ {print int($6/1024)}' "$work/spes-$1.time")
  echo "$line" | sed -E 's/.* in ([0-9.]+) s: ([0-9]+) tokens\/s, ([0-9.]+) MB\/s/\2 \3 \1/' | tr '\n' ' '
  echo "$rss"
}

read -r t1 m1 s1 r1 <<<"$(run_spes 1)"
read -r t2 m2 s2 r2 <<<"$(run_spes 2)"
read -r at am as <<<"$(RAYON_NUM_THREADS=2 "$py" "$root/scripts/bench_tokenize.py" anchor --input "$corpus" --tokenizer "$tokenizer")"
ratio() { "$py" -c "print(f'{$1/$2:.2f}')"; }
echo "corpus: $corpus (16 files, $text_mb MB of zstd JSON lines, $mb MB uncompressed); tokenizer: gpt-neox-olmo-dolma-v1_5"
echo
echo "| run | seconds | tokens/s | MB/s of text | peak RSS (MB) | vs anchor |"
echo "|---|---|---|---|---|---|"
echo "| spes tokenize, 1 thread | $s1 | $t1 | $m1 | $r1 | $(ratio "$t1" "$at")× |"
echo "| spes tokenize, 2 threads | $s2 | $t2 | $m2 | $r2 | $(ratio "$t2" "$at")× |"
echo "| anchor: tokenizers $("$py" -c 'import tokenizers; print(tokenizers.__version__)') encode_batch (Python, 2 threads; encode time only) | $as | $at | $am | | 1.00× |"
echo
echo "2 threads / 1 thread: $(ratio "$t2" "$t1")×"
