#!/usr/bin/env python3
"""The corpus and the anchor of scripts/bench-tokenize.sh.

  make   --out DIR --mb N --files K --texts A.txt B.txt ...
         writes K JSON-lines files of about N MB in all: documents of 1 to 8 paragraphs drawn
         (seeded) from the given texts, each line {"text": ..., "id": ...}.
  anchor --input DIR --tokenizer tokenizer.json
         the same documents through the `tokenizers` library's own encode_batch, in batches of
         1 MB of text as spes encodes them; prints tokens/s, MB/s of text and the seconds spent
         in encode_batch alone (reading is not counted).
"""
import argparse
import glob
import json
import os
import random
import subprocess
import sys
import time


def make(a):
    paragraphs = []
    for path in a.texts:
        with open(path, encoding="utf-8") as f:
            paragraphs += [p.strip() for p in f.read().split("\n\n") if p.strip()]
    rng = random.Random(0)
    os.makedirs(a.out, exist_ok=True)
    per_file = a.mb * 1_000_000 // a.files
    doc = 0
    for i in range(a.files):
        path = os.path.join(a.out, f"part-{i:03d}.jsonl")
        written = 0
        with open(path, "w", encoding="utf-8") as f:
            while written < per_file:
                text = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 8)))
                line = json.dumps({"text": text, "id": doc}) + "\n"
                f.write(line)
                written += len(line)
                doc += 1
    print(f"{doc} documents in {a.files} files", file=sys.stderr)


def documents(path):
    """Lines of a .jsonl or .jsonl.zst file, decompressed by the zstd tool."""
    if path.endswith(".zst"):
        p = subprocess.Popen(["zstd", "-dc", path], stdout=subprocess.PIPE)
        for line in p.stdout:
            yield json.loads(line)["text"]
        p.wait()
    else:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def anchor(a):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer)
    files = sorted(glob.glob(os.path.join(a.input, "*.jsonl*")))
    totals = {"documents": 0, "tokens": 0, "text_bytes": 0, "seconds": 0.0}

    def encode(batch, size):
        t = time.perf_counter()
        enc = tok.encode_batch(batch, add_special_tokens=False)
        totals["seconds"] += time.perf_counter() - t
        totals["documents"] += len(batch)
        totals["tokens"] += sum(len(e.ids) for e in enc) + len(batch)  # + one EOS each
        totals["text_bytes"] += size

    for path in files:
        batch, size = [], 0
        for text in documents(path):
            batch.append(text)
            size += len(text.encode("utf-8"))
            if size >= 1 << 20:
                encode(batch, size)
                batch, size = [], 0
        if batch:
            encode(batch, size)
    t = totals
    print(f"{t['tokens'] / t['seconds']:.0f} {t['text_bytes'] / 1e6 / t['seconds']:.2f} {t['seconds']:.1f}")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--mb", type=int, default=1024)
    m.add_argument("--files", type=int, default=16)
    m.add_argument("--texts", nargs="+", required=True)
    n = sub.add_parser("anchor")
    n.add_argument("--input", required=True)
    n.add_argument("--tokenizer", required=True)
    a = p.parse_args()
    make(a) if a.cmd == "make" else anchor(a)


if __name__ == "__main__":
    main()
