"""Reference computations with Hugging Face transformers, for spes's parity tests.

  logits  --model DIR --tokens T.json --out L.npy     logits [B, T, V] of token rows (fp32, CPU)
  loglik  --model DIR --pairs P.json --ctx N --eos E --out S.json
                                                      sum log p(continuation | context) per pair of
                                                      token-id lists, truncated as spes does
  dense   --arch qwen3|llama --out DIR --seed S       a small random dense model, saved
  lazy    --model DIR                                 the config's model built on the meta device (no
                                                      weights in memory): class and parameter count
Run with the project's virtualenv: .venv/bin/python scripts/hf_reference.py ...
"""
import argparse, json
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Olmo2Config, Qwen2Config, Qwen3Config


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def cmd_logits(a):
    model = load(a.model)
    tokens = torch.tensor(json.load(open(a.tokens)), dtype=torch.long)
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
    np.save(a.out, logits)


def cmd_loglik(a):
    model = load(a.model)
    out = []
    with torch.no_grad():
        for ctx, cont in json.load(open(a.pairs)):
            ids = (ctx or [a.eos]) + cont
            ids = ids[-(a.ctx + 1):]
            n = min(len(cont), len(ids) - 1)
            inp = torch.tensor([ids[:-1]])
            logp = torch.log_softmax(model(inp).logits[0].double(), -1)
            tgt = torch.tensor(ids[1:])
            picked = logp[torch.arange(len(tgt)), tgt]
            out.append(picked[-n:].sum().item())
    json.dump(out, open(a.out, "w"))


def cmd_dense(a):
    torch.manual_seed(a.seed)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2)
    if a.arch == "qwen3":
        config = Qwen3Config(head_dim=16, rope_theta=1000000.0, **common)
    elif a.arch == "qwen2":
        config = Qwen2Config(rope_theta=10000.0, **common)
    elif a.arch == "olmo2":
        config = Olmo2Config(rope_theta=500000.0, **common)
    else:
        config = LlamaConfig(rope_theta=10000.0, **common)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(a.out, safe_serialization=True)


def cmd_lazy(a):
    import os
    config = AutoConfig.from_pretrained(a.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    index = os.path.join(a.model, "model.safetensors.index.json")
    stored = json.load(open(index))["metadata"]["total_size"] if os.path.exists(index) else None
    print(json.dumps({"architecture": type(model).__name__, "model_type": config.model_type,
                      "params": params, "stored_bytes": stored, "device": str(next(model.parameters()).device)}))


p = argparse.ArgumentParser()
sub = p.add_subparsers(dest="cmd", required=True)
s = sub.add_parser("logits"); s.add_argument("--model"); s.add_argument("--tokens"); s.add_argument("--out")
s = sub.add_parser("loglik"); s.add_argument("--model"); s.add_argument("--pairs"); s.add_argument("--out")
s.add_argument("--ctx", type=int); s.add_argument("--eos", type=int)
s = sub.add_parser("dense"); s.add_argument("--arch", choices=["qwen3", "qwen2", "olmo2", "llama"]); s.add_argument("--out")
s.add_argument("--seed", type=int, default=0)
s = sub.add_parser("lazy"); s.add_argument("--model")
a = p.parse_args()
{"logits": cmd_logits, "loglik": cmd_loglik, "dense": cmd_dense, "lazy": cmd_lazy}[a.cmd](a)
