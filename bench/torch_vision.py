#!/usr/bin/python3
"""torch_vision.py — the baseline of bench/vision.lua: tide's vision encoder (nn.VisionEncoder + nn.VisionProjector,
spec/vision.md §4-§6) written in PyTorch eager on the CPU, timed over forward + backward of loss = sum(y * R).

The math, block for block as lua/tide/nn/vision.lua:
  x = Linear(patches) + bicubic(pos table [G, G, d] -> [h, w, d] per image; F.interpolate, align_corners=False)
  block: x += wo(attn(rope2d(split(wqkv(LN0(x)))))); x += fc1(gelu_tanh(fc0(LN1(x)))); LayerNorms eps 1e-5
  attention: softmax(q k^T * hd^-1/2) v inside each image. PyTorch 1.13 has no F.scaled_dot_product_attention, so
  it is written out (matmul, softmax, matmul); images of equal patch count are stacked into one batched matmul
  (a plain loop over images where all sizes differ), the fastest correct eager form found here.
  rope2d (vision.md §4): slot j rotates the adjacent pair (x[2j], x[2j+1]) by pos * 10000^(-4 floor(j/2) / hd),
  pos = col for even j, row for odd j.
  final LayerNorm; projector: LN per patch, 2x2 merge gather, linear_1, GELU (erf), linear_2.

Weights, patches, grids and R come from a safetensors file bench/vision.lua writes (names vit.<tide name>,
proj.<tide name>, input.patches, input.R; tide's output and gradients as tide.y, tide.grad.<name>).

Modes:
  torch_vision.py --serve FIFO   read commands from FIFO, answer one JSON line each on stdout:
      load PATH              build the model from PATH, run forward + backward once, compare with tide's output
                             and gradients: {"max_abs_delta": ..., "max_rel_delta": ..., "worst": name, ...}
      time THREADS REPS      torch.set_num_threads(THREADS), REPS timed steps: {"threads": n, "step_s": [...]}
      profile THREADS        each op of the step alone (forward, backward from ones; best of 5): {"ops": {...}}
      gemm THREADS REPS      REPS steps under torch.autograd.profiler: the self CPU time of the BLAS products
                             (aten::addmm, mm, bmm, baddbmm, addmm_) per step against a plain step's time (one
                             before each): {"gemm_s": median, "step_s": median, "share": gemm_s / step_s, ...}
      quit
  torch_vision.py --memory PATH --grids 16x16,24x32 [--threads N]
      a fresh process: one step on random patches for those grids; prints the RSS before the step and the peak
      RSS (ru_maxrss) after it: {"rss_before": bytes, "maxrss_after": bytes, "growth": bytes, "patches": n}
Run with OMP_WAIT_POLICY=PASSIVE (as bench/torch_dense.py).
"""
import argparse
import json
import os
import resource
import struct
import sys
import time

import torch
import torch.nn.functional as F

PROFILE_REPS = 5   # best of, per op of the profile (a shared machine: best of 2 was too noisy to compare)
DTYPES = {"F32": torch.float32, "F64": torch.float64, "I32": torch.int32, "I64": torch.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8:8 + n].decode("utf-8"))
    meta = head.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, e in head.items():
        a, b = e["data_offsets"]
        buf = bytearray(data[base + a:base + b])
        t = torch.frombuffer(buf, dtype=DTYPES[e["dtype"]]) if b > a else torch.empty(0, dtype=DTYPES[e["dtype"]])
        out[name] = t.reshape(e["shape"]).clone()
    return out, meta


def parse_grids(s):
    return [tuple(int(v) for v in g.split("x")) for g in s.split(",")]


class Vision:
    def __init__(self, tensors, meta):
        self.p = {k[4:]: v for k, v in tensors.items() if k.startswith("vit.")}
        self.q = {k[5:]: v for k, v in tensors.items() if k.startswith("proj.")}
        for t in list(self.p.values()) + list(self.q.values()):
            t.requires_grad_(True)
        self.heads = int(meta["heads"])
        self.layers = int(meta["layers"])
        self.theta = float(meta.get("theta", "10000"))
        self.eps = float(meta.get("eps", "1e-5"))
        self.dim = self.p["patch_embed.proj.weight"].shape[0]
        self.geometry = None

    def params(self):
        return [("vit." + k, v) for k, v in self.p.items()] + [("proj." + k, v) for k, v in self.q.items()]

    def set_grids(self, grids):
        """precomputes what depends only on the grids: RoPE tables, merge index, groups of equal-size images"""
        hd = self.dim // self.heads
        rows, cols = [], []
        for h, w in grids:
            r = torch.arange(h, dtype=torch.float64)[:, None].expand(h, w).reshape(-1)
            c = torch.arange(w, dtype=torch.float64)[None, :].expand(h, w).reshape(-1)
            rows.append(r)
            cols.append(c)
        row, col = torch.cat(rows), torch.cat(cols)
        j = torch.arange(hd // 2)
        freq = self.theta ** (-4.0 * (j // 2).double() / hd)
        pos = torch.where((j % 2 == 0)[None, :], col[:, None], row[:, None])   # [T, hd/2]
        ang = pos * freq[None, :]
        self.cos = torch.cos(ang).float()[:, None, :]                          # [T, 1, hd/2]
        self.sin = torch.sin(ang).float()[:, None, :]
        idx, base = [], 0
        for h, w in grids:
            for r in range(h // 2):
                for c in range(w // 2):
                    for ih in range(2):
                        for iw in range(2):
                            idx.append(base + (2 * r + ih) * w + (2 * c + iw))
            base += h * w
        self.merge = torch.tensor(idx, dtype=torch.long)
        self.lengths = [h * w for h, w in grids]
        groups = {}
        for i, n in enumerate(self.lengths):
            groups.setdefault(n, []).append(i)
        self.groups = list(groups.items())
        self.grids = grids

    def rope(self, x):
        # x [T, H, hd]: adjacent pairs
        T, H, hd = x.shape
        x = x.reshape(T, H, hd // 2, 2)
        x0, x1 = x[..., 0], x[..., 1]
        return torch.stack((x0 * self.cos - x1 * self.sin, x0 * self.sin + x1 * self.cos), dim=-1).reshape(T, H, hd)

    def attention(self, q, k, v):
        # q, k, v [T, H, hd] -> [T, H * hd]; softmax inside each image
        T, H, hd = q.shape
        scale = hd ** -0.5
        qs, ks, vs = q.split(self.lengths), k.split(self.lengths), v.split(self.lengths)
        outs = [None] * len(self.lengths)
        for n, members in self.groups:
            qq = torch.stack([qs[i] for i in members]).transpose(1, 2)     # [B, H, n, hd]
            kk = torch.stack([ks[i] for i in members]).transpose(1, 2)
            vv = torch.stack([vs[i] for i in members]).transpose(1, 2)
            a = torch.softmax(torch.matmul(qq, kk.transpose(-2, -1)) * scale, dim=-1)
            o = torch.matmul(a, vv).transpose(1, 2).reshape(len(members), n, H * hd)
            for b, i in enumerate(members):
                outs[i] = o[b]
        return torch.cat(outs, 0)

    def pos_interp(self):
        tbl = self.p["patch_embed.pos_emb.weight"]                          # [G, G, d]
        G = tbl.shape[0]
        img = tbl.permute(2, 0, 1).unsqueeze(0)                             # [1, d, G, G]
        parts = []
        for h, w in self.grids:
            if (h, w) == (G, G):
                parts.append(tbl.reshape(G * G, -1))
            else:
                r = F.interpolate(img, size=(h, w), mode="bicubic", align_corners=False)
                parts.append(r[0].permute(1, 2, 0).reshape(h * w, -1))
        return torch.cat(parts, 0)

    def forward(self, patches):
        p, q = self.p, self.q
        d, H = self.dim, self.heads
        x = F.linear(patches, p["patch_embed.proj.weight"], p["patch_embed.proj.bias"]) + self.pos_interp()
        T = x.shape[0]
        for i in range(self.layers):
            b = "encoder.blocks.%d." % i
            h = F.layer_norm(x, (d,), p[b + "norm0.weight"], p[b + "norm0.bias"], self.eps)
            qkv = F.linear(h, p[b + "wqkv.weight"], p[b + "wqkv.bias"])
            qq = self.rope(qkv[:, :d].reshape(T, H, d // H))
            kk = self.rope(qkv[:, d:2 * d].reshape(T, H, d // H))
            vv = qkv[:, 2 * d:].reshape(T, H, d // H)
            x = x + F.linear(self.attention(qq, kk, vv), p[b + "wo.weight"], p[b + "wo.bias"])
            h = F.layer_norm(x, (d,), p[b + "norm1.weight"], p[b + "norm1.bias"], self.eps)
            h = F.gelu(F.linear(h, p[b + "mlp.fc0.weight"], p[b + "mlp.fc0.bias"]), approximate="tanh")
            x = x + F.linear(h, p[b + "mlp.fc1.weight"], p[b + "mlp.fc1.bias"])
        x = F.layer_norm(x, (d,), p["encoder.final_layernorm.weight"], p["encoder.final_layernorm.bias"], self.eps)
        y = F.layer_norm(x, (d,), q["pre_norm.weight"], q["pre_norm.bias"], self.eps)
        y = y.index_select(0, self.merge).reshape(-1, 4 * d)
        y = F.gelu(F.linear(y, q["linear_1.weight"], q["linear_1.bias"]))
        return F.linear(y, q["linear_2.weight"], q["linear_2.bias"])

    def step(self, patches, R):
        for _, t in self.params():
            t.grad = None
        y = self.forward(patches)
        (y * R).sum().backward()
        return y


def compare(model, t, patches, R):
    y = model.step(patches, R)
    worst = {"max_abs_delta": 0.0, "max_rel_delta": 0.0, "worst": None}
    per = {}
    items = [("y", y.detach(), t["tide.y"])]
    items += [("grad." + n, v.grad, t["tide.grad." + n]) for n, v in model.params()]
    for name, mine, theirs in items:
        if mine is None:
            mine = torch.zeros_like(theirs)
        delta = (mine - theirs).abs().max().item()
        ref = max(mine.abs().max().item(), 1e-30)
        per[name] = {"abs": delta, "rel": delta / ref}
        worst["max_abs_delta"] = max(worst["max_abs_delta"], delta)
        if delta / ref > worst["max_rel_delta"]:
            worst["max_rel_delta"], worst["worst"] = delta / ref, name
    worst["y_max_abs_delta"] = per["y"]["abs"]
    worst["y_max_rel_delta"] = per["y"]["rel"]
    worst["tensors_compared"] = len(items)
    return worst


def profile(model, patches, R):
    """each op of the step alone at the step's shapes: best of 5 of forward, then backward from a ones gradient
    (the pieces of bench/vision.lua's tide profile, same names)"""
    p, q, d, H = model.p, model.q, model.dim, model.heads
    T, hd = patches.shape[0], model.dim // model.heads
    b = "encoder.blocks.0."
    mlp = p[b + "mlp.fc0.weight"].shape[0]

    def leaf(*shape):
        return torch.randn(*shape).requires_grad_(True)

    h, hm, m4 = leaf(T, d), leaf(T, mlp), leaf(T // 4, 4 * d)
    mp = leaf(T // 4, q["linear_1.weight"].shape[0])
    qq, kk, vv = leaf(T, H, hd), leaf(T, H, hd), leaf(T, H, hd)
    pieces = [
        ("patch_embed Linear", lambda: F.linear(patches, p["patch_embed.proj.weight"], p["patch_embed.proj.bias"])),
        ("pos_interp", model.pos_interp),
        ("LayerNorm", lambda: F.layer_norm(h, (d,), p[b + "norm0.weight"], p[b + "norm0.bias"], model.eps)),
        ("wqkv Linear", lambda: F.linear(h, p[b + "wqkv.weight"], p[b + "wqkv.bias"])),
        ("rope2d (q and k)", lambda: model.rope(qq) + model.rope(kk)),
        ("varlen_attention", lambda: model.attention(qq, kk, vv)),
        ("wo Linear", lambda: F.linear(h, p[b + "wo.weight"], p[b + "wo.bias"])),
        ("mlp fc0 Linear", lambda: F.linear(h, p[b + "mlp.fc0.weight"], p[b + "mlp.fc0.bias"])),
        ("gelu (tanh)", lambda: F.gelu(hm, approximate="tanh")),
        ("mlp fc1 Linear", lambda: F.linear(hm, p[b + "mlp.fc1.weight"], p[b + "mlp.fc1.bias"])),
        ("residual add", lambda: h + h),
        ("merge index_select", lambda: h.index_select(0, model.merge)),
        ("proj linear_1", lambda: F.linear(m4, q["linear_1.weight"], q["linear_1.bias"])),
        ("gelu_erf", lambda: F.gelu(mp)),
        ("proj linear_2", lambda: F.linear(mp, q["linear_2.weight"], q["linear_2.bias"])),
    ]
    out = {}
    for name, fn in pieces:
        bf = bb = float("inf")
        g = None   # the output's gradient, ones, made outside the timing (as bench/vision.lua)
        for _ in range(PROFILE_REPS):
            t0 = time.perf_counter()
            o = fn()
            t1 = time.perf_counter()
            if g is None:
                g = torch.ones_like(o)
                t0 = time.perf_counter()
                o = fn()
                t1 = time.perf_counter()
            o.backward(g)
            t2 = time.perf_counter()
            bf, bb = min(bf, t1 - t0), min(bb, t2 - t1)
        out[name] = {"forward_s": bf, "backward_s": bb}
    return out


GEMM_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm_")


def gemm_share(model, patches, R, reps):
    """how much of PyTorch's step is BLAS products: the bound on what a faster non-GEMM side can buy. The GEMM time is
    the products' self time under the profiler (long calls: the profiler's per-op cost is small beside them); the step
    is timed without the profiler (it slows the many small ops), one plain step before each profiled one"""
    gemm, step, prof_step, by_op = [], [], [], {}
    for _ in range(reps):
        t0 = time.perf_counter()
        model.step(patches, R)
        step.append(time.perf_counter() - t0)
        with torch.autograd.profiler.profile() as prof:
            t0 = time.perf_counter()
            model.step(patches, R)
            prof_step.append(time.perf_counter() - t0)
        g = 0.0
        for e in prof.key_averages():
            if e.key in GEMM_OPS:
                g += e.self_cpu_time_total * 1e-6
                by_op[e.key] = e.self_cpu_time_total * 1e-6
        gemm.append(g)
    med = lambda v: sorted(v)[len(v) // 2]
    g, w = med(gemm), med(step)
    return {"gemm_s": g, "step_s": w, "profiled_step_s": med(prof_step), "share": g / w, "by_op": by_op}


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(fifo):
    model = patches = R = None
    with open(fifo, "r") as cmds:
        for line in cmds:
            w = line.split()
            if not w:
                continue
            try:
                if w[0] == "load":
                    t, meta = read_safetensors(w[1])
                    model = Vision(t, meta)
                    model.set_grids(parse_grids(meta["grids"]))
                    patches, R = t["input.patches"], t["input.R"]
                    out = compare(model, t, patches, R)
                    out["framework"] = "pytorch " + torch.__version__
                    out["attention"] = "matmul + softmax + matmul per group of equal-size images (no SDPA in this torch)"
                    reply(out)
                elif w[0] == "time":
                    torch.set_num_threads(int(w[1]))
                    times = []
                    for _ in range(int(w[2])):
                        t0 = time.perf_counter()
                        model.step(patches, R)
                        times.append(time.perf_counter() - t0)
                    reply({"threads": torch.get_num_threads(), "step_s": times})
                elif w[0] == "profile":
                    torch.set_num_threads(int(w[1]))
                    reply({"threads": torch.get_num_threads(), "ops": profile(model, patches, R)})
                elif w[0] == "gemm":
                    torch.set_num_threads(int(w[1]))
                    out = gemm_share(model, patches, R, int(w[2]))
                    out["threads"] = torch.get_num_threads()
                    reply(out)
                elif w[0] == "quit":
                    reply({"bye": True})
                    return
                else:
                    reply({"error": "unknown command " + w[0]})
            except Exception as e:  # the Lua side reports it and stops
                reply({"error": "%s: %s" % (type(e).__name__, e)})


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(path, grids, threads):
    torch.set_num_threads(threads)
    t, meta = read_safetensors(path)
    model = Vision(t, meta)
    model.set_grids(grids)
    n = sum(h * w for h, w in grids)
    torch.manual_seed(1)
    patches = torch.randn(n, t["input.patches"].shape[1])
    R = torch.randn(n // 4, t["input.R"].shape[1])
    del t
    before = rss_bytes()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model.step(patches, R)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reply({"patches": n, "rss_before": before, "maxrss_before": maxrss_before, "maxrss_after": after,
           "growth": after - before, "growth_valid": maxrss_before <= after})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", help="command FIFO")
    ap.add_argument("--memory", help="safetensors file (weights) for one fresh-process memory step")
    ap.add_argument("--grids", help="with --memory: 16x16,24x32,...")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve)
    elif a.memory and a.grids:
        memory(a.memory, parse_grids(a.grids), a.threads)
    else:
        ap.error("give --serve FIFO or --memory PATH --grids ...")


if __name__ == "__main__":
    main()
