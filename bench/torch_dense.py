#!/usr/bin/python3
"""torch_dense.py — the baseline of bench/step_dense.lua: the same dense Transformer LM written in
PyTorch (CPU, eager), timed over forward + backward + AdamW step + zero_grad. Prints one JSON object
on stdout; tok_per_s is B x T over the median timed step.

The model matches tide's nn.TransformerLM layer for layer: token embedding; per block pre-norm
RMSNorm -> q/k/v projections (no bias) -> RoPE (rotate-half pairs (i, i + D/2), theta 10000) -> causal
softmax attention written out as matmul + mask + softmax + matmul -> o projection -> residual;
RMSNorm -> SwiGLU MLP down(silu(gate(x)) * up(x)) -> residual; final RMSNorm; untied lm_head.
AdamW groups as tide's optimiser: weight decay on matrices except the embedding table.

Run it with OMP_WAIT_POLICY=PASSIVE: PyTorch's OpenMP loops and OpenBLAS's threads otherwise spin
against each other for the cores.

  torch_dense.py --vocab 50304 --dim 768 --layers 12 --heads 12 --ffn 2048 --seq 64 --batch 4 \
                 [--warmup 2] [--steps 5] [--threads N] [--foreach 0|1] [--ddp N --bucket-mb MB]

--serve FIFO: the model and optimiser are built once and the process answers one JSON command per line read from
FIFO with one JSON line on stdout, so that a benchmark can interleave its rounds with tide's (bench/step_dense.lua):
  {"cmd": "info"}               -> {"framework", "threads", "omp_wait_policy", "params", "params_embedding"}
  {"cmd": "steps", "n": N}      -> {"step_s": [N step times], "losses": [...]}
  {"cmd": "quit"}               -> {"ok": true}, then the process exits
(--warmup steps run before the first answer; --steps is unused.)

--ddp N: the baseline of bench/dist.lua: N processes (torch.multiprocessing) under DistributedDataParallel on the
gloo backend (rendezvous through a file, traffic over loopback), --batch rows and --threads threads each, gradients
summed in buckets of --bucket-mb MB overlapped with the backward (DDP's own scheme); rank 0's step times are
reported.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch_serve import serve_fifo


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq, head_dim, theta):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim // 2, dtype=torch.float64) * 2.0 / head_dim))
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def rope(x, cos, sin):
    # x [B, H, T, D]; pairs (i, i + D/2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, heads, std, out_std):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        for lin, s in ((self.q_proj, std), (self.k_proj, std), (self.v_proj, std), (self.o_proj, out_std)):
            nn.init.normal_(lin.weight, std=s)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        H, D = self.heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, H, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, H, D).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        scores = scores.masked_fill(mask, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, dim, hidden, std, out_std):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        for lin, s in ((self.gate_proj, std), (self.up_proj, std), (self.down_proj, out_std)):
            nn.init.normal_(lin.weight, std=s)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        std, out_std = 0.02, 0.02 / math.sqrt(2 * a.layers)
        self.input_layernorm = RMSNorm(a.dim, 1e-5)
        self.self_attn = Attention(a.dim, a.heads, std, out_std)
        self.post_attention_layernorm = RMSNorm(a.dim, 1e-5)
        self.mlp = MLP(a.dim, a.ffn, std, out_std)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class TransformerLM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.dim)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList([Block(a) for _ in range(a.layers)])
        self.norm = RMSNorm(a.dim, 1e-5)
        self.lm_head = nn.Linear(a.dim, a.vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, std=0.02)
        cos, sin = rope_tables(a.seq, a.dim // a.heads, 10000.0)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("mask", torch.triu(torch.ones(a.seq, a.seq, dtype=torch.bool), 1), persistent=False)

    def forward(self, ids, targets):
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x, self.cos, self.sin, self.mask)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def token_ids(n, mult, vocab):
    # the same deterministic ids as bench/step_dense.lua: (i * mult) mod vocab for i = 1..n
    return torch.tensor([(i * mult) % vocab for i in range(1, n + 1)], dtype=torch.long)


def adamw(model, a):
    """AdamW groups as tide's optimiser: weight decay on matrices except the embedding table."""
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2 and not n.startswith("embed_tokens")]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2 or n.startswith("embed_tokens")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-4, betas=(0.9, 0.95), eps=1e-8, foreach=bool(a.foreach))


def timed_steps(model, opt, ids, targets, a, before=None):
    """warmup + steps of forward, backward, AdamW, zero_grad; the times of the steps after the warm-up, every loss"""
    times, losses = [], []
    for s in range(a.warmup + a.steps):
        if before:
            before()
        t0 = time.perf_counter()
        loss = model(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if s >= a.warmup:
            times.append(dt)
    return times, losses


def run_rank(rank, a, init_file, out_file):
    import torch.distributed as dist
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=a.ddp)
    torch.manual_seed(1)
    model = TransformerLM(a)
    # the constant buffers (RoPE tables, the bool causal mask gloo cannot broadcast) are the same on every rank
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["cos", "sin", "mask"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    opt = adamw(model, a)
    n_tok = a.batch * a.seq
    ids = token_ids(n_tok * (rank + 1), 7919, a.vocab)[-n_tok:].view(a.batch, a.seq)
    targets = token_ids(n_tok * (rank + 1), 104729, a.vocab)[-n_tok:].view(a.batch, a.seq)
    times, losses = timed_steps(ddp, opt, ids, targets, a, dist.barrier)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"times": times, "losses": losses,
                       "params": sum(p_.numel() for p_ in model.parameters())}, f)
    dist.barrier()
    dist.destroy_process_group()


def main_ddp(a):
    import tempfile
    import torch.multiprocessing as mp
    d = tempfile.mkdtemp()
    init_file, out_file = os.path.join(d, "rendezvous"), os.path.join(d, "out.json")
    mp.spawn(run_rank, args=(a, init_file, out_file), nprocs=a.ddp, join=True)
    with open(out_file) as f:
        r = json.load(f)
    times = r["times"]
    out = {
        "framework": "pytorch " + torch.__version__ + " DistributedDataParallel (gloo)",
        "ranks": a.ddp, "threads": a.threads, "bucket_mb": a.bucket_mb,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "params": r["params"], "tokens_per_step_per_rank": a.batch * a.seq,
        "warmup": a.warmup, "steps": a.steps, "step_s": times,
        "step_s_median": statistics.median(times), "losses": r["losses"],
    }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


def serve(a, model, opt, ids, targets):
    """the --serve loop: commands from the FIFO, one JSON answer line each on stdout"""
    timed_steps(model, opt, ids, targets, argparse.Namespace(warmup=0, steps=a.warmup))
    info = {"framework": "pytorch " + torch.__version__, "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "params": sum(p_.numel() for p_ in model.parameters()),
            "params_embedding": model.embed_tokens.weight.numel()}
    def handle(c):
        if c.get("cmd") == "info":
            return info
        if c.get("cmd") == "steps":
            n = int(c.get("n", 1))
            times, losses = timed_steps(model, opt, ids, targets, argparse.Namespace(warmup=0, steps=n))
            return {"step_s": times, "losses": losses}
        return {"error": "unknown command " + repr(c.get("cmd"))}

    serve_fifo(a.serve, handle)

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("vocab", "dim", "layers", "heads", "ffn", "seq", "batch"):
        p.add_argument("--" + name, type=int, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--foreach", type=int, default=0, help="1: AdamW's multi-tensor (foreach) implementation")
    p.add_argument("--ddp", type=int, default=0, help="N > 1: N processes under DistributedDataParallel (gloo)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    p.add_argument("--serve", default="", help="FIFO: answer JSON commands read from it (see the top of the file)")
    a = p.parse_args()
    if a.dim % a.heads or (a.dim // a.heads) % 2:
        p.error(f"dim {a.dim} must split into {a.heads} heads of an even size")
    if a.steps < 1 or a.warmup < 0 or a.threads < 1:
        p.error("steps and threads must be >= 1, warmup >= 0")

    if a.ddp > 1:
        return main_ddp(a)
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    model = TransformerLM(a)
    opt = adamw(model, a)
    n_tok = a.batch * a.seq
    ids = token_ids(n_tok, 7919, a.vocab).view(a.batch, a.seq)
    targets = token_ids(n_tok, 104729, a.vocab).view(a.batch, a.seq)

    if a.serve:
        return serve(a, model, opt, ids, targets)
    times, losses = timed_steps(model, opt, ids, targets, a)

    n_params = sum(p_.numel() for p_ in model.parameters())
    out = {
        "framework": "pytorch " + torch.__version__,
        "threads": torch.get_num_threads(),
        "adamw_foreach": bool(a.foreach),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "params": n_params,
        "params_embedding": model.embed_tokens.weight.numel(),
        "tokens_per_step": n_tok,
        "warmup": a.warmup,
        "steps": a.steps,
        "step_s": times,
        "step_s_mean": sum(times) / len(times),
        "step_s_median": statistics.median(times),
        "tok_per_s": n_tok / statistics.median(times),
        "losses": losses,
    }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
