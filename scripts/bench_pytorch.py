"""The `tiny` spes model and training step in PyTorch eager, for a side-by-side tokens/s figure.

Same shapes (vocab 8192, d 256, 4 layers, 4 heads, 16 SwiGLU experts of 256, top-2, QK-norm,
RoPE), same dropless dispatch (sort by expert, per-expert index_select, one index_add), same
losses and AdamW. Run: .venv/bin/python scripts/bench_pytorch.py [--steps 5 --warmup 2]
"""
import argparse, math, resource, time
import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq-len", type=int, default=256)
args = p.parse_args()
V, D, L, H, E, K, HID = 8192, 256, 4, 4, 16, 2, 256
HD = D // H
torch.manual_seed(0)

def w(*shape):
    return torch.nn.init.trunc_normal_(torch.empty(*shape), std=0.02, a=-0.06, b=0.06).requires_grad_()

def ones(n):
    return torch.ones(n, requires_grad=True)

params = {"embed": w(V, D), "head": w(V, D), "norm": ones(D)}
for l in range(L):
    for n in ("q", "k", "v", "o"):
        params[f"{l}.{n}"] = w(D, D)
    for n in ("qn", "kn", "an", "fn"):
        params[f"{l}.{n}"] = ones(D)
    params[f"{l}.router"] = w(E, D)
    for e in range(E):
        params[f"{l}.{e}.gate"] = w(HID, D)
        params[f"{l}.{e}.up"] = w(HID, D)
        params[f"{l}.{e}.down"] = w(D, HID)

def rope(t):
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
    f = torch.outer(torch.arange(t).float(), inv)
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()

def rot(x, cos, sin):
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin

def forward(tokens):
    b, t = tokens.shape
    cos, sin = rope(t)
    x = F.embedding(tokens, params["embed"])
    lbs, rzs = [], []
    for l in range(L):
        h = F.rms_norm(x, (D,), params[f"{l}.an"], 1e-6)
        q = F.rms_norm(h @ params[f"{l}.q"].T, (D,), params[f"{l}.qn"], 1e-6)
        k = F.rms_norm(h @ params[f"{l}.k"].T, (D,), params[f"{l}.kn"], 1e-6)
        v = h @ params[f"{l}.v"].T
        q, k, v = (z.view(b, t, H, HD).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(rot(q, cos, sin), rot(k, cos, sin), v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(b, t, D) @ params[f"{l}.o"].T
        h = F.rms_norm(x, (D,), params[f"{l}.fn"], 1e-6).view(b * t, D)
        logits = h @ params[f"{l}.router"].T
        probs = logits.softmax(-1)
        topw, topi = probs.topk(K, -1)
        flat = topi.view(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E)
        token_of = order // K
        outs = []
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                xe = h.index_select(0, token_of[start : start + n])
                hid = F.silu(xe @ params[f"{l}.{e}.gate"].T) * (xe @ params[f"{l}.{e}.up"].T)
                outs.append(hid @ params[f"{l}.{e}.down"].T)
            start += n
        out = torch.cat(outs) * topw.view(-1)[order].unsqueeze(-1)
        x = x + torch.zeros_like(h).index_add(0, token_of, out).view(b, t, D)
        lbs.append((counts.float() * probs.mean(0)).sum() * E / (b * t * K))
        rzs.append(torch.logsumexp(logits, -1).square().mean())
    x = F.rms_norm(x, (D,), params["norm"], 1e-6)
    return x @ params["head"].T, torch.stack(lbs).mean(), torch.stack(rzs).sum()

opt = torch.optim.AdamW(list(params.values()), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
times = []
for i in range(args.warmup + args.steps):
    batch = torch.randint(V, (args.batch_size, args.seq_len + 1))
    start = time.perf_counter()
    logits, lb, rz = forward(batch[:, :-1])
    logits = logits.reshape(-1, V).float()
    lse = torch.logsumexp(logits, -1)
    ce = (lse - logits.gather(1, batch[:, 1:].reshape(-1, 1)).squeeze(1)).mean()
    loss = ce + 1e-4 * lse.square().mean() + 0.01 * lb + 0.001 * rz
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=False)
    if i >= args.warmup:
        times.append(time.perf_counter() - start)
times.sort()
median = times[len(times) // 2]
tokens = args.batch_size * args.seq_len
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"| PyTorch {torch.__version__} eager | {args.batch_size}x{args.seq_len} | step {median*1e3:.0f} ms | {tokens/median:.0f} tokens/s | peak RSS {peak:.0f} MiB | threads {torch.get_num_threads()} |")
