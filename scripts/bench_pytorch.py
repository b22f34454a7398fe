"""spes's model and training step written in plain PyTorch: the other side of
`spes bench vs-pytorch`, which runs this script alternately with `spes bench step` and prints one table.

Same shapes (any preset: `--model` takes spes's ModelConfig as JSON), same decoder (pre-norm
blocks, QK-norm over the projection or per head, RoPE, grouped-query attention, dropless top-k
SwiGLU experts), same dispatch (one sort, one gather in expert order, per-expert slices or
`torch._grouped_mm`, one index_add), same losses (CE, z-loss, load balancing, router z-loss),
gradient clipping and AdamW at a fixed learning rate. Experts beyond `--own-experts` are frozen
as on a SPES node. Variants: `eager` (torch.optim.AdamW's default implementation), `fused`
(AdamW(fused=True)) and `compile` (the loss under torch.compile, fused AdamW).
Prints one JSON line. The reference for what a careful PyTorch user would write by hand,
not a port of spes's kernels: full fp32 logits, autocast for bf16.
"""
import argparse, json, resource, time
import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--model", required=True, help="spes ModelConfig as JSON")
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
p.add_argument("--variant", default="eager", choices=["eager", "fused", "compile"])
p.add_argument("--moe-kernel", default="loop", choices=["loop", "grouped"])
p.add_argument("--own-experts", type=int)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq-len", type=int, default=256)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--threads", type=int)
args = p.parse_args()
cfg = json.loads(args.model)
if cfg.get("norm_placement", "pre") != "pre" or cfg.get("qkv_bias"):
    raise SystemExit("bench_pytorch.py: only pre-norm models without q/k/v biases")
if args.threads:
    torch.set_num_threads(args.threads)
dev = torch.device(args.device)
V, D, L = cfg["vocab_size"], cfg["d_model"], cfg["n_layers"]
HQ, HKV, HD = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
E, K, HID, EPS = cfg["n_experts"], cfg["top_k"], cfg["expert_hidden"], cfg["norm_eps"]
QK = cfg["qk_norm"]
own = E if args.own_experts is None else args.own_experts
torch.manual_seed(0)


def w(*shape, train=True):
    std = cfg["init_std"]
    t = torch.nn.init.trunc_normal_(torch.empty(*shape, device=dev), std=std, a=-3 * std, b=3 * std)
    return t.requires_grad_(train)


def ones(n):
    return torch.ones(n, device=dev, requires_grad=True)


params = {"embed": w(V, D), "head": w(V, D), "norm": ones(D)}
for l in range(L):
    params[f"{l}.q"], params[f"{l}.o"] = w(HQ * HD, D), w(D, HQ * HD)
    params[f"{l}.k"], params[f"{l}.v"] = w(HKV * HD, D), w(HKV * HD, D)
    params[f"{l}.an"], params[f"{l}.fn"] = ones(D), ones(D)
    if QK != "none":
        n = HD if QK == "per_head" else None
        params[f"{l}.qn"] = ones(n or HQ * HD)
        params[f"{l}.kn"] = ones(n or HKV * HD)
    params[f"{l}.router"] = w(E, D)
    for e in range(E):
        for part, shape in (("gate", (HID, D)), ("up", (HID, D)), ("down", (D, HID))):
            params[f"{l}.{e}.{part}"] = w(*shape, train=e < own)
trainable = [t for t in params.values() if t.requires_grad]

inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, HD, 2, device=dev).float() / HD))
freqs = torch.outer(torch.arange(args.seq_len, device=dev).float(), inv)
emb = torch.cat([freqs, freqs], -1)
COS, SIN = emb.cos(), emb.sin()


def rot(x):
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return x * COS + torch.cat([-x2, x1], -1) * SIN


def attention(l, h, b, t):
    q, k, v = h @ params[f"{l}.q"].T, h @ params[f"{l}.k"].T, h @ params[f"{l}.v"].T
    if QK == "full":
        q = F.rms_norm(q, (HQ * HD,), params[f"{l}.qn"], EPS)
        k = F.rms_norm(k, (HKV * HD,), params[f"{l}.kn"], EPS)
    q = q.view(b, t, HQ, HD).transpose(1, 2)
    k = k.view(b, t, HKV, HD).transpose(1, 2)
    v = v.view(b, t, HKV, HD).transpose(1, 2)
    if QK == "per_head":
        q = F.rms_norm(q, (HD,), params[f"{l}.qn"], EPS)
        k = F.rms_norm(k, (HD,), params[f"{l}.kn"], EPS)
    y = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True, enable_gqa=HQ != HKV)
    return y.transpose(1, 2).reshape(b, t, HQ * HD) @ params[f"{l}.o"].T


def experts(l, xs, counts):
    if args.moe_kernel == "grouped":
        offs = counts.cumsum(0).to(torch.int32)
        # autocast does not cover _grouped_mm: cast as spes does.
        xs = xs.to(torch.bfloat16 if args.precision == "bf16" else torch.float32)
        stack = lambda part: torch.stack(
            [params[f"{l}.{e}.{part}"] for e in range(E)]).to(xs.dtype).transpose(1, 2)
        mm = lambda a, b: torch._grouped_mm(a, b, offs=offs)
        return mm(F.silu(mm(xs, stack("gate"))) * mm(xs, stack("up")), stack("down"))
    outs = []
    for e, xe in enumerate(xs.split(counts.tolist())):
        if len(xe):
            hid = F.silu(xe @ params[f"{l}.{e}.gate"].T) * (xe @ params[f"{l}.{e}.up"].T)
            outs.append(hid @ params[f"{l}.{e}.down"].T)
    return torch.cat(outs)


def moe(l, h):
    logits = (h @ params[f"{l}.router"].T).float()
    probs = logits.softmax(-1)
    topw, topi = probs.topk(K, -1)
    if cfg["normalize_topk"]:
        topw = topw / topw.sum(-1, keepdim=True)
    flat = topi.view(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add(0, flat, torch.ones_like(flat))
    token_of = order // K
    out = experts(l, h.index_select(0, token_of), counts).float()
    out = out * topw.view(-1)[order].unsqueeze(-1)
    y = torch.zeros(h.shape, device=dev).index_add(0, token_of, out)
    lb = (counts.float() * probs.mean(0)).sum() * E / (h.shape[0] * K)
    return y, lb, torch.logsumexp(logits, -1).square().mean()


def loss_of(batch):
    tokens, targets = batch[:, :-1], batch[:, 1:]
    b, t = tokens.shape
    x = F.embedding(tokens, params["embed"])
    lbs, rzs = [], []
    for l in range(L):
        x = x + attention(l, F.rms_norm(x, (D,), params[f"{l}.an"], EPS), b, t)
        h = F.rms_norm(x, (D,), params[f"{l}.fn"], EPS).view(b * t, D)
        y, lb, rz = moe(l, h)
        x = x + y.view(b, t, D).to(x.dtype)
        lbs.append(lb)
        rzs.append(rz)
    x = F.rms_norm(x, (D,), params["norm"], EPS)
    logits = (x @ params["head"].T).reshape(-1, V).float()
    lse = torch.logsumexp(logits, -1)
    ce = (lse - logits.gather(1, targets.reshape(-1, 1)).squeeze(1)).mean()
    return ce + 1e-4 * lse.square().mean() + 0.01 * torch.stack(lbs).mean() + 0.001 * torch.stack(rzs).sum()


def step_loss(batch):
    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        return loss_of(batch)


fn = torch.compile(step_loss) if args.variant == "compile" else step_loss
opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                        fused=args.variant != "eager" or None)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


times = []
for i in range(args.warmup + args.steps):
    batch = torch.randint(V, (args.batch_size, args.seq_len + 1), device=dev)
    sync()
    start = time.perf_counter()
    loss = fn(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=False)
    loss.item()
    sync()
    if i >= args.warmup:
        times.append(time.perf_counter() - start)


times.sort()
median = times[len(times) // 2]
tokens = args.batch_size * args.seq_len
print(json.dumps({
    "torch": torch.__version__,
    "threads": torch.get_num_threads(),
    "total_params": sum(t.numel() for t in params.values()),
    "trainable_params": sum(t.numel() for t in trainable),
    "step_ms": median * 1e3,
    "tokens_per_s": tokens / median,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    # As `spes bench step` reports it: the caching allocator's own peaks on CUDA, RSS on CPU.
    "device_memory_source": "cuda_caching_allocator" if dev.type == "cuda" else "rss",
    "device_peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None,
    "device_peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20 if dev.type == "cuda" else None,
}))
