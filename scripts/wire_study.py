#!/usr/bin/env python3
"""How much of a round's change each compressor carries, on the changes `spes simulate
--dump-changes DIR --dump-rounds R` wrote (docs/results/sync-cost.md, "Where a round's change
lives").

For the shared matrices it compares the mean of the nodes' compressed changes with the mean of
their changes (what the server averages against what an exact wire would); for the experts, each
owner's compressed change with its change. One round, no error feedback: the share of the energy
(squared norm) a round carries at once.

    .venv/bin/python scripts/wire_study.py runs/changes 70
"""
import glob
import re
import sys

import torch
from safetensors.torch import load_file

GROUP = 64


def quantize(x, bits):
    """x as a quantized wire sends it: codes with a bf16 scale per GROUP values."""
    flat = x.reshape(-1)
    n = (flat.numel() + GROUP - 1) // GROUP * GROUP
    g = torch.nn.functional.pad(flat, (0, n - flat.numel())).view(-1, GROUP)
    if bits == 2:
        s = g.abs().mean(1, keepdim=True)
        lim = 1
    else:
        lim = (1 << (bits - 1)) - 1
        s = g.abs().amax(1, keepdim=True) / lim
    s = s.to(torch.bfloat16).float()
    codes = (g / s.clamp_min(1e-30)).round().clamp(-lim, lim)
    return (codes * s).view(-1)[: flat.numel()].view_as(x)


def low_rank(x, rank, bits):
    """Rank-`rank` factors of x, the singular values split evenly, each factor quantized."""
    u, s, v = torch.linalg.svd(x, full_matrices=False)
    root = s[:rank].sqrt()
    left = quantize((u[:, :rank] * root).T.contiguous(), bits).T
    right = quantize((v[:rank].T * root).T.contiguous(), bits)
    return left @ right


def top_k(x, k, chunk=4096):
    """The k largest entries of every chunk of `chunk` values, exact (no 2-bit levels)."""
    flat = x.reshape(-1)
    body = flat.numel() // chunk * chunk
    out = torch.zeros_like(flat)
    rows = flat[:body].view(-1, chunk)
    idx = rows.abs().topk(k, 1).indices
    out[:body].view(-1, chunk).scatter_(1, idx, rows.gather(1, idx))
    return out.view_as(x)


def strided(x, stride):
    """One value in `stride`, exact."""
    flat = x.reshape(-1).clone()
    keep = torch.zeros_like(flat)
    keep[::stride] = 1
    return (flat * keep).view_as(x)


COMPRESSORS = {
    "lowrank r8 8-bit": lambda x: low_rank(x, 8, 8),
    "lowrank r16 4-bit": lambda x: low_rank(x, 16, 4),
    "lowrank r32 2-bit": lambda x: low_rank(x, 32, 2),
    "top-64 of 4096": lambda x: top_k(x, 64),
    "top-256 of 4096": lambda x: top_k(x, 256),
    "1 in 4 values": lambda x: strided(x, 4),
    "2-bit, every value": lambda x: quantize(x, 2),
}


def main():
    directory, round_ = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    files = sorted(glob.glob(f"{directory}/round-{round_}-node-*.safetensors"))
    if not files:
        sys.exit(f"no round-{round_}-node-*.safetensors in {directory}")
    nodes = [load_file(f) for f in files]
    shared = sorted(n for n in nodes[0] if all(n in x for x in nodes))
    carried = {k: [0.0, 0.0] for k in COMPRESSORS}
    groups = {}
    ratio = [0.0, 0.0]
    for name in shared:
        xs = [x[name].float() for x in nodes]
        if xs[0].dim() != 2 or xs[0].numel() <= 4096:
            continue
        mean = sum(xs) / len(xs)
        energy = mean.square().sum().item()
        ratio[0] += energy
        ratio[1] += sum(x.square().sum().item() for x in xs) / len(xs)
        kind = re.sub(r"\d+", "#", name)
        for k, c in COMPRESSORS.items():
            lost = (sum(c(x) for x in xs) / len(xs) - mean).square().sum().item()
            for acc in (carried[k], groups.setdefault(kind, {}).setdefault(k, [0.0, 0.0])):
                acc[0] += lost
                acc[1] += energy
    experts = {k: [0.0, 0.0] for k in COMPRESSORS}
    for x in nodes:
        for name, t in x.items():
            if name in shared or t.dim() != 2:
                continue
            t = t.float()
            energy = t.square().sum().item()
            for k, c in COMPRESSORS.items():
                experts[k][0] += (c(t) - t).square().sum().item()
                experts[k][1] += energy
    share = lambda acc: 1 - acc[0] / acc[1]
    print(f"round {round_}, {len(nodes)} nodes; |mean change|² / mean |node change|² of the "
          f"shared matrices: {ratio[0] / ratio[1]:.3f}\n")
    print("| carried at once | " + " | ".join(COMPRESSORS) + " |")
    print("|---" * (len(COMPRESSORS) + 1) + "|")
    print("| shared matrices (mean change) | "
          + " | ".join(f"{100 * share(v):.0f} %" for v in carried.values()) + " |")
    for kind, g in sorted(groups.items()):
        print(f"| `{kind}` | " + " | ".join(f"{100 * share(v):.0f} %" for v in g.values()) + " |")
    print("| experts (owner's change) | "
          + " | ".join(f"{100 * share(v):.0f} %" for v in experts.values()) + " |")


if __name__ == "__main__":
    main()
