#!/usr/bin/env python3
"""Prints each crate's graph of top-level modules (who names whom through `crate::` or a
root-level `super::`) and fails if any crate has an import circle among them.

A top-level module is `src/<name>.rs` or `src/<name>/`; the crate root (lib.rs, main.rs) is
left out, since every module hangs off it. Test code counts like any other: a circle that only
tests close is still a circle to read.

    python3 scripts/module-graph.py [--quiet]      # exit 1 on a circle
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def paths_after(text, prefix):
    """First path segment of every `prefix::seg` and `prefix::{seg, …}` in `text`."""
    out = []
    for m in re.finditer(re.escape(prefix) + r"::", text):
        rest = text[m.end():]
        if rest.startswith("{"):
            depth, item, items = 0, "", []
            for c in rest[1:]:
                if c == "{":
                    depth += 1
                elif c == "}":
                    if depth == 0:
                        items.append(item)
                        break
                    depth -= 1
                elif c == "," and depth == 0:
                    items.append(item)
                    item = ""
                    continue
                item += c
            for it in items:
                word = IDENT.match(it.strip())
                if word:
                    out.append(word.group(0))
        else:
            word = IDENT.match(rest)
            if word:
                out.append(word.group(0))
    return out


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def crate_graph(src):
    mods = {}
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix == ".rs" and p.stem not in ("lib", "main"):
            mods[p.stem] = [p]
        elif p.is_dir():
            mods[p.name] = sorted(p.rglob("*.rs"))
    edges = {m: set() for m in mods}
    for m, files in mods.items():
        for f in files:
            text = strip_comments(f.read_text())
            names = paths_after(text, "crate")
            # In src/<m>.rs, `super::` is the crate root.
            if f.parent == src:
                names += paths_after(text, "super")
            for n in names:
                if n in mods and n != m:
                    edges[m].add(n)
    return edges


def circles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    quiet = "--quiet" in sys.argv[1:]
    bad = []
    for crate in sorted((ROOT / "crates").iterdir()):
        src = crate / "src"
        if not src.is_dir():
            continue
        edges = crate_graph(src)
        if not quiet:
            print(f"{crate.name}:")
            for m in sorted(edges):
                print(f"  {m} -> {', '.join(sorted(edges[m])) or '(none)'}")
        for c in circles(edges):
            bad.append(f"{crate.name}: {{{', '.join(c)}}}")
    if bad:
        print("import circles between top-level modules:", file=sys.stderr)
        for b in bad:
            print(f"  {b}", file=sys.stderr)
        sys.exit(1)
    print("module graph: no import circles")


if __name__ == "__main__":
    main()
