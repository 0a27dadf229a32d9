"""Train kvlab's bundled default model: a 1.09 M-parameter byte-level Llama on Tiny Shakespeare.

What this is: a self-contained PyTorch (CPU) script that trains the small Llama-family
decoder shipped as `kvlab/assets/shakespeare-1m.bin` and writes its metadata to
`kvlab/assets/shakespeare-1m.json`. It is not part of the kvlab package: torch is needed
only to run this script, never to import or run kvlab.

Reproduce the shipped model (from the repository root). On 2 otherwise idle CPU cores a
step takes about 1 s, so about 25 minutes in all; the shipped run took 56 minutes because
the cores were shared with other work. Bit-exact results also need the same torch version
and thread count (2, set by --threads):

    python training/train_default_model.py --data ../shared/data/tinyshakespeare.txt \
        --steps 1300 --batch-size 8 --seed 1337 --sample

Model (the llama2.c architecture, so kvlab's C and NumPy forward passes can load it):
  - bytes as tokens: vocab 256, token id = byte value, no BOS/EOS;
  - dim 128, 6 layers, 8 query heads and 2 key/value heads (GQA) of head_dim 16,
    SwiGLU MLP of width 352, context 512;
  - pre-norm blocks x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x)), RMSNorm eps 1e-5;
  - RoPE, theta 10000, on interleaved pairs (x[2i], x[2i+1]) as in llama2.c / Meta;
  - no biases; the classifier is tied to the token embedding.

Data: the first 90 % of the file's bytes train the model, the last 10 % validate it.

Output: llama2.c "version 1" checkpoint (256-byte header, then float32 arrays in the
order att norms, ffn norms, final norm, embedding, wq, wk, wv, wo, w1, w2, w3) and a JSON
file with the hyperparameters, the data split, the final losses and a greedy sample that
other code uses as a golden test.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The architecture is fixed: the loaders in kvlab read exactly these numbers from the header.
CONFIG = dict(dim=128, hidden_dim=352, n_layers=6, n_heads=8, n_kv_heads=2, head_dim=16,
              vocab_size=256, max_seq_len=512, norm_eps=1e-5, rope_theta=10000.0)

TRAIN_FRACTION = 0.9
SAMPLE_PROMPT = "ROMEO:\n"
SAMPLE_LENGTH = 200


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float):
    """cos and sin of pos * theta^(-2i/head_dim), each shaped (max_seq_len, head_dim // 2)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of each head. x: (B, heads, T, head_dim)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated_even = even * cos - odd * sin
    rotated_odd = even * sin + odd * cos
    # Interleave back so that element 2i is the rotated even part and 2i+1 the odd part.
    return torch.stack((rotated_even, rotated_odd), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        self.wq = nn.Linear(c["dim"], self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, c["dim"], bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Query head h reads kv head h // kv_mul: repeat each kv head kv_mul times in place.
        kv_mul = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(kv_mul, dim=1)
        v = v.repeat_interleave(kv_mul, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(head_dim)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.attention_norm = RMSNorm(c["dim"], c["norm_eps"])
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c["dim"], c["norm_eps"])
        self.feed_forward = SwiGLU(c["dim"], c["hidden_dim"])

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class ByteLlama(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c["vocab_size"], c["dim"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["n_layers"]))
        self.norm = RMSNorm(c["dim"], c["norm_eps"])
        cos, sin = rope_tables(c["head_dim"], c["max_seq_len"], c["rope_theta"])
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: small normal weights, residual projections shrunk by depth so the
        # residual stream does not grow with the number of layers.
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02
                if name.endswith("wo.weight") or name.endswith("w2.weight"):
                    std = 0.02 / math.sqrt(2 * self.c["n_layers"])
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab)."""
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) @ self.tok_embeddings.weight.T  # tied classifier


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------
def load_split(path: str):
    raw = np.fromfile(path, dtype=np.uint8)
    n_train = int(len(raw) * TRAIN_FRACTION)
    return torch.from_numpy(raw.astype(np.int64)), n_train


def random_batch(data: torch.Tensor, batch_size: int, context: int, gen: torch.Generator):
    """batch_size random windows: inputs are bytes [i, i+context), targets are shifted by one."""
    starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=gen)
    offsets = torch.arange(context + 1)
    windows = data[starts[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def estimate_loss(model: ByteLlama, data: torch.Tensor, batches: list) -> float:
    """Mean cross-entropy (nats per byte) over a fixed list of window start offsets."""
    model.eval()
    context = model.c["max_seq_len"]
    offsets = torch.arange(context + 1)
    total = 0.0
    for starts in batches:
        windows = data[starts[:, None] + offsets]
        logits = model(windows[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    model.train()
    return total / len(batches)


def fixed_eval_starts(n_bytes: int, n_batches: int, batch_size: int, context: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n_bytes - context - 1, (batch_size,), generator=gen)
            for _ in range(n_batches)]


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warmup to peak, then cosine decay to floor at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------
def export_llama2c_v1(model: ByteLlama, path: str) -> int:
    """Write the llama2.c "version 1" checkpoint; return the number of floats written."""
    c = model.c
    layers = model.layers

    def stack(get):
        return torch.stack([get(layer).detach() for layer in layers])

    arrays = [
        stack(lambda l: l.attention_norm.weight),
        stack(lambda l: l.ffn_norm.weight),
        model.norm.weight.detach(),
        model.tok_embeddings.weight.detach(),
        stack(lambda l: l.attention.wq.weight),
        stack(lambda l: l.attention.wk.weight),
        stack(lambda l: l.attention.wv.weight),
        stack(lambda l: l.attention.wo.weight),
        stack(lambda l: l.feed_forward.w1.weight),
        stack(lambda l: l.feed_forward.w2.weight),
        stack(lambda l: l.feed_forward.w3.weight),
    ]
    header = struct.pack("<Ii", 0x616B3432, 1)
    header += struct.pack("<7i", c["dim"], c["hidden_dim"], c["n_layers"], c["n_heads"],
                          c["n_kv_heads"], c["vocab_size"], c["max_seq_len"])
    header += struct.pack("<B", 1)  # shared_classifier: the classifier is the embedding
    header += b"\0" * (256 - len(header))
    n_floats = 0
    with open(path, "wb") as f:
        f.write(header)
        for a in arrays:
            flat = a.float().contiguous().numpy().astype("<f4").ravel()
            f.write(flat.tobytes())
            n_floats += flat.size
    size = os.path.getsize(path)
    assert size == 256 + 4 * n_floats, f"{path}: {size} bytes, expected {256 + 4 * n_floats}"
    return n_floats


@torch.no_grad()
def greedy_sample(model: ByteLlama, prompt: str, n_new: int):
    """Greedy argmax continuation, recomputing the whole sequence each step (no cache)."""
    model.eval()
    ids = list(prompt.encode("utf-8"))
    new_ids, margins = [], []
    for _ in range(n_new):
        logits = model(torch.tensor([ids]))[0, -1].float()
        top2 = torch.topk(logits, 2).values
        margins.append((top2[0] - top2[1]).item())
        next_id = int(torch.argmax(logits))
        ids.append(next_id)
        new_ids.append(next_id)
    return new_ids, min(margins)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.path.join(REPO_ROOT, "..", "shared", "data",
                                                  "tinyshakespeare.txt"))
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "kvlab", "assets"))
    p.add_argument("--name", default="shakespeare-1m")
    p.add_argument("--steps", type=int, default=1300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--final-eval-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-kv-heads", type=int, default=CONFIG["n_kv_heads"],
                   help="key/value heads: 2 is the bundled GQA model, 8 (one per query head) "
                        "the MHA model the GQA lab converts")
    p.add_argument("--sample", action="store_true",
                   help=f"greedy-generate {SAMPLE_LENGTH} bytes from {SAMPLE_PROMPT!r} and "
                        "store them in the JSON as a golden test")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    c = dict(CONFIG, n_kv_heads=args.n_kv_heads)
    context = c["max_seq_len"]

    data, n_train = load_split(args.data)
    train, val = data[:n_train], data[n_train:]
    print(f"data: {len(data):,} bytes; train [0, {n_train:,}), validation [{n_train:,}, {len(data):,})")

    model = ByteLlama(c)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({c})")

    # Weight decay on matrices only (embedding included); norm weights are left alone.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    batch_gen = torch.Generator().manual_seed(args.seed)
    eval_sets = {
        "train": (train, fixed_eval_starts(len(train), args.eval_batches, args.batch_size, context, args.seed + 1)),
        "val": (val, fixed_eval_starts(len(val), args.eval_batches, args.batch_size, context, args.seed + 2)),
    }

    start = time.time()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        if step % args.eval_every == 0 and step > 0:
            losses = {k: estimate_loss(model, d, s) for k, (d, s) in eval_sets.items()}
            tqdm.write(f"step {step:5d}  train {losses['train']:.4f}  val {losses['val']:.4f}  "
                       f"({time.time() - start:.0f} s)")
        lr = lr_at(step, args.steps, args.warmup, args.lr, args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = random_batch(train, args.batch_size, context, batch_gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
    train_seconds = time.time() - start

    final_sets = {
        "train": (train, fixed_eval_starts(len(train), args.final_eval_batches, args.batch_size, context, args.seed + 3)),
        "val": (val, fixed_eval_starts(len(val), args.final_eval_batches, args.batch_size, context, args.seed + 4)),
    }
    final = {k: estimate_loss(model, d, s) for k, (d, s) in final_sets.items()}
    print(f"final ({args.final_eval_batches} batches of {args.batch_size} x {context}): "
          f"train {final['train']:.4f}  val {final['val']:.4f}  nats/byte; "
          f"trained in {train_seconds:.0f} s")

    os.makedirs(args.out_dir, exist_ok=True)
    bin_path = os.path.join(args.out_dir, args.name + ".bin")
    n_floats = export_llama2c_v1(model, bin_path)
    print(f"wrote {bin_path}: {os.path.getsize(bin_path):,} bytes ({n_floats:,} floats)")

    command = (f"python training/train_default_model.py --data ../shared/data/tinyshakespeare.txt "
               f"--steps {args.steps} --batch-size {args.batch_size} --seed {args.seed}"
               + (f" --n-kv-heads {args.n_kv_heads} --name {args.name}"
                  if args.n_kv_heads != CONFIG["n_kv_heads"] else "")
               + (" --sample" if args.sample else ""))
    meta = {
        "name": args.name,
        "tokenizer": "bytes",
        "norm_eps": c["norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_interleaved": True,
        "n_params": n_params,
        "train_loss": round(final["train"], 4),
        "val_loss": round(final["val"], 4),
        "data": f"Tiny Shakespeare (tinyshakespeare.txt, {len(data):,} bytes, public domain)",
        "split": {"train": [0, n_train], "validation": [n_train, len(data)]},
        "steps": args.steps,
        "batch_size": args.batch_size,
        "context": context,
        "seed": args.seed,
        "training_command": command,
        "train_seconds": round(train_seconds, 1),
    }
    if args.sample:
        ids, margin = greedy_sample(model, SAMPLE_PROMPT, SAMPLE_LENGTH)
        text = bytes(ids).decode("utf-8", errors="replace")
        print(f"greedy sample (min top-1/top-2 logit margin {margin:.4f}):\n{SAMPLE_PROMPT}{text}")
        meta["greedy_sample"] = {"prompt": SAMPLE_PROMPT, "ids": ids,
                                 "min_logit_margin": round(margin, 6)}
    json_path = os.path.join(args.out_dir, args.name + ".json")
    with open(json_path, "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
