#!/usr/bin/env bash
# Rebuilds crates/spes-cli/assets/default-corpus.jsonl.gz, the corpus embedded in `spes` for the
# demo, from Debian's `fortunes` and `fortunes-min` packages (BSD licence, see
# crates/spes-cli/assets/DEFAULT-CORPUS-LICENSE). One fortune = one document.
# Leaves out ASCII-art files (not prose) and the `ethnic` and `men-women` files.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get download fortunes fortunes-min >/dev/null
for deb in ./*.deb; do dpkg-deb -x "$deb" extracted; done
python3 - extracted/usr/share/games/fortunes "$root/crates/spes-cli/assets/default-corpus.jsonl.gz" <<'PY'
import gzip, json, os, sys
src, dst = sys.argv[1], sys.argv[2]
skip = {"art", "ascii-art", "ethnic", "men-women"}
n = 0
with gzip.GzipFile(dst, "wb", mtime=0) as raw:
    out = raw
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name in skip or "." in name or os.path.islink(path):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        for doc in text.split("\n%\n"):
            doc = doc.strip("%\n")
            if doc.strip():
                out.write((json.dumps({"text": doc, "source": name}) + "\n").encode())
                n += 1
print(f"{n} documents -> {dst}")
PY
