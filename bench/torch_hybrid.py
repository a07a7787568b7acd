#!/usr/bin/python3
"""torch_hybrid.py — the baseline of bench/hybrid.lua: tide's hybrid language model (nn.HybridLM) written in
PyTorch eager for the benchmark, trained with the same step: loss, backward, gradient clipping, AdamW, zero_grad,
then the Quantile Balancing update of every MoE layer's selection bias.

The model is tide's forward math, piece by piece (spec/*.md; lua/tide/nn/*.lua), with tide's parameter names
(formats.md §2), so that a tide safetensors file loads with no renaming:
  * embedding; L layers, each PreNorm (RMSNorm) -> token mixer -> PreNorm -> FFN, connected by Block Attention
    Residuals (attnres.md §3: the embedding and one sum per completed block of B layers are the sources of every
    mix, the running partial sum of the current block the last one); a final mix, RMSNorm, an untied lm_head;
    mean cross-entropy over every target;
  * KDA (kda.md §1-§4): q/k/v projections, depthwise causal conv (4 taps) + SiLU, per-head L2 norm (q carries
    dk^-1/2), beta = sigmoid(W_b x), the lower-bounded decay gate g = lb * sigmoid(exp(A_log) (W_fb W_fa x + dt_bias)),
    the chunk-16 WY form (batched matmuls inside every chunk, one Python step per chunk for the state), per-head
    RMSNorm with one shared gain, sigmoid output gate, output projection;
  * gated NoPE MLA (mla.md): low-rank q with its RMSNorm, the kv latent with its RMSNorm, the shared unrotated
    rope-slot key, causal softmax attention (scale (d_n + d_r)^-1/2), sigmoid output gate, output projection;
  * FFNs: layer 0 a dense SiTU-GLU MLP (moe.md §6, kappa 4 and 25); the others MoE (moe.md): sigmoid router on the
    full x or the latent router (§3, cosine or dot), TopK of s + b in float64 (b: the QB selection bias, a buffer),
    weights p = rho s_sel / (sum s_sel + 1e-20), LatentMoE (§7: shared down-projection, experts in the latent,
    RMSNorm of the weighted aggregate, up-projection), the experts dispatched by a stable sort and run one GEMM pair
    per expert, a shared SiTU-GLU expert at full width;
  * Quantile Balancing (§4.1, the exact estimator tide uses on one rank): after the step, c_t = the (k+1)-th
    largest s + b, margins s - c_t, theta_j their (1 - k/n) quantile (linear interpolation), b = -theta centred.
AdamW groups as tide's optimiser (optim.md §1): decay on matrices except the embedding, the conv taps, the AttnRes
pseudo-queries and the latent router's expert vectors; the multi-tensor (foreach) AdamW, the faster of the two on this
model's ~100 small tensors.

Usage:
  torch_hybrid.py --check FILE [--steps N] [--threads N]
      FILE: a safetensors file bench/hybrid.lua wrote (the model config in its metadata, the weights under their
      tide names, input.ids / input.targets, tide's loss and gradients under tide.*); prints one JSON object: the
      loss and gradient norm on both sides, the worst per-tensor gradient delta, and with --steps N the losses of
      N training steps from these weights (tide's are in the metadata when it ran them).
  torch_hybrid.py --serve FIFO [--threads N]
      one JSON command per line read from FIFO, one JSON line back on stdout (tide.results.server):
      {"cmd": "info"}                       -> {"framework", "threads", "omp_wait_policy"}
      {"cmd": "check", "path": F, "steps": N} -> what --check prints
      {"cmd": "setup", "path": F, "warmup": W} -> the model, optimiser and batch of F for timing; W untimed steps
      {"cmd": "steps", "n": N}              -> {"step_s": [...], "losses": [...]}
      {"cmd": "quit"}                       -> {"ok": true}, then the process exits
  Weights are read with the small safetensors reader below (JSON header + raw little-endian data).
"""
import argparse
import json
import math
import os
import statistics
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch_serve import serve_fifo

DTYPES = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}
SITU_GATE, SITU_LIN = 4.0, 25.0     # kappa1, kappa2 (moe.md §6)


# ---- safetensors ------------------------------------------------------------------------------------------------
def read_safetensors(path):
    """-> ({name: tensor}, metadata dict)"""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    base = 8 + n
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, e in header.items():
        dt = DTYPES.get(e["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name} has dtype {e['dtype']} (this reader takes F32, F64, I64, I32)")
        lo, hi = e["data_offsets"]
        buf = bytearray(data[base + lo:base + hi])
        t = torch.frombuffer(buf, dtype=dt) if hi > lo else torch.empty(0, dtype=dt)
        out[name] = t.reshape(e["shape"]).clone()
    return out, meta


# ---- building blocks --------------------------------------------------------------------------------------------
def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rmsnorm(x, self.weight, self.eps)


def linear(i, o, std):
    lin = nn.Linear(i, o, bias=False)
    nn.init.normal_(lin.weight, std=std)
    return lin


def situ(g, u):
    # sigma takes the uncapped g (moe.md §6)
    return (SITU_GATE * torch.tanh(g / SITU_GATE) * torch.sigmoid(g)) * (SITU_LIN * torch.tanh(u / SITU_LIN))


class MLP(nn.Module):
    """down(phi_g(gate(x)) * phi_u(up(x))): SiTU-GLU or SwiGLU"""

    def __init__(self, dim, hidden, activation, std, out_std):
        super().__init__()
        self.activation = activation
        self.gate_proj, self.up_proj = linear(dim, hidden, std), linear(dim, hidden, std)
        self.down_proj = linear(hidden, dim, out_std)

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        h = situ(g, u) if self.activation == "situ" else F.silu(g) * u
        return self.down_proj(h)


class ShortConv(nn.Module):
    """the depthwise tap tensor [C, 1, K] of one causal conv (checkpoint name <prefix>_conv1d.weight)"""

    def __init__(self, channels, size):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.empty(channels, 1, size).uniform_(-0.5, 0.5))

    def forward(self, x):
        # x [B, T, C] -> SiLU(causal conv): y_t = sum_j w[:, j] x_{t-K+1+j}, zeros before the row start
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.size - 1, 0)), self.weight, groups=self.weight.shape[0])
        return F.silu(y).transpose(1, 2)


def l2norm(x, scale=1.0):
    return x * (scale * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6))


def kda_chunk(q, k, v, g, beta, C):
    """the chunkwise KDA kernel (kda.md §4), every chunk's intra-chunk part as batched matmuls and one step per
    chunk for the state. q, k, g [B, H, T, dk], v [B, H, T, dv], beta [B, H, T]; zero initial state -> o [B, H, T, dv]"""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    pad = (-T) % C
    if pad:     # zero tokens at the end (k = 0, beta = 0, g = 0) change no earlier output
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, g = (t.reshape(B, H, N, C, dk) for t in (q, k, g))
    v = v.reshape(B, H, N, C, dv)
    beta = beta.reshape(B, H, N, C, 1)
    G = g.cumsum(3)                                   # inclusive cumsum per channel
    eG, emG = G.exp(), (-G).exp()
    Kh, Kc, Qh = k * eG, k * emG, q * eG
    Gl = G[:, :, :, -1:, :]                          # G_c, the chunk's total
    Kr = k * (Gl - G).exp()
    eye = torch.eye(C, dtype=q.dtype)
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    A = (beta * Kh) @ Kc.transpose(-1, -2)
    A = A.masked_fill(~strict, 0.0)                  # select, never multiply: the upper triangle can hold e^80
    # (I + A)^-1 for a strictly lower-triangular A of size 16: the exact nilpotent product
    A2 = A @ A
    A4 = A2 @ A2
    A8 = A4 @ A4
    M = ((eye - A) @ (eye + A2)) @ ((eye + A4) @ (eye + A8)) if C == 16 else torch.linalg.inv(eye + A)
    W = M @ (beta * Kh)
    Ut = M @ (beta * v)
    P = (Qh @ Kc.transpose(-1, -2)).masked_fill(~torch.ones(C, C, dtype=torch.bool).tril(), 0.0)
    S = torch.zeros(B, H, dk, dv, dtype=q.dtype)
    egl = Gl.exp().transpose(-1, -2)                 # [B, H, N, dk, 1]
    outs = []
    for n in range(N):
        U = Ut[:, :, n] - W[:, :, n] @ S
        outs.append(Qh[:, :, n] @ S + P[:, :, n] @ U)
        S = egl[:, :, n] * S + Kr[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, 2).reshape(B, H, N * C, dv)
    return o[:, :, :T]


def inv_softplus(dt):
    return dt + math.log(1 - math.exp(-dt))


class KDA(nn.Module):
    def __init__(self, dim, c, std, out_std, eps):
        super().__init__()
        H, dk = c["heads"], c["head_dim"]
        self.H, self.dk, self.chunk, self.lb = H, dk, c.get("chunk", 16), c.get("gate_lower_bound", -5.0)
        if c.get("gate_form", "bounded") != "bounded":
            raise ValueError("torch_hybrid: only the lower-bounded KDA gate is written here (gate_form = bounded)")
        K, inner = c.get("conv_size", 4), H * dk
        self.q_proj, self.k_proj = linear(dim, inner, std), linear(dim, inner, std)
        self.v_proj, self.g_proj = linear(dim, inner, std), linear(dim, inner, std)
        self.o_proj = linear(inner, dim, out_std)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = ShortConv(inner, K), ShortConv(inner, K), ShortConv(inner, K)
        self.f_a_proj, self.f_b_proj = linear(dim, dk, std), linear(dk, inner, std)
        self.b_proj = linear(dim, H, std)
        self.A_log = nn.Parameter(torch.zeros(H))
        dt = torch.empty(inner, dtype=torch.float64).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
        self.dt_bias = nn.Parameter(torch.tensor([inv_softplus(float(x)) for x in dt], dtype=torch.float32))
        self.o_norm = RMSNorm(dk, eps)

    def forward(self, x):
        B, T, _ = x.shape
        H, dk = self.H, self.dk
        q = l2norm(self.q_conv1d(self.q_proj(x)).reshape(B, T, H, dk), 1.0 / math.sqrt(dk))
        k = l2norm(self.k_conv1d(self.k_proj(x)).reshape(B, T, H, dk))
        v = self.v_conv1d(self.v_proj(x)).reshape(B, T, H, dk)
        beta = torch.sigmoid(self.b_proj(x))                                    # [B, T, H]
        z = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, dk)
        g = self.lb * torch.sigmoid(self.A_log.exp().reshape(H, 1) * (z + self.dt_bias.reshape(H, dk)))
        tr = lambda t: t.transpose(1, 2)                                       # noqa: E731  [B, H, T, .]
        o = tr(kda_chunk(tr(q), tr(k), tr(v), tr(g), beta.transpose(1, 2), self.chunk))   # [B, T, H, dv]
        y = self.o_norm(o) * torch.sigmoid(self.g_proj(x)).reshape(B, T, H, dk)
        return self.o_proj(y.reshape(B, T, H * dk))


class MLA(nn.Module):
    def __init__(self, dim, c, std, out_std, eps):
        super().__init__()
        H, dn, dr, dc = c["heads"], c["nope_dim"], c.get("rope_dim", 0), c["kv_rank"]
        dv = c.get("v_dim", dn)
        self.H, self.dn, self.dr, self.dc, self.dv = H, dn, dr, dc, dv
        self.scale = 1.0 / math.sqrt(dn + dr)
        self.q_rank = c.get("q_rank")
        if self.q_rank:
            self.q_a_proj = linear(dim, self.q_rank, std)
            self.q_a_layernorm = RMSNorm(self.q_rank, eps)
            self.q_b_proj = linear(self.q_rank, H * (dn + dr), std)
        else:
            self.q_proj = linear(dim, H * (dn + dr), std)
        self.kv_a_proj_with_mqa = linear(dim, dc + dr, std)
        self.kv_a_layernorm = RMSNorm(dc, eps)
        self.kv_b_proj = linear(dc, H * (dn + dv), std)
        self.gate = c.get("gate", True)
        if self.gate:
            self.g_proj = linear(dim, H * dv, std)
        self.o_proj = linear(H * dv, dim, out_std)

    def forward(self, x, mask):
        B, T, _ = x.shape
        H, dn, dr, dc, dv = self.H, self.dn, self.dr, self.dc, self.dv
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_rank else self.q_proj(x)
        q = q.reshape(B, T, H, dn + dr).transpose(1, 2)                        # [B, H, T, dn + dr]
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[..., :dc])
        kvb = self.kv_b_proj(c).reshape(B, T, H, dn + dv)
        k = kvb[..., :dn]
        if dr > 0:     # the rope slot: one key for every head, never rotated (NoPE)
            k = torch.cat((k, kv[..., dc:].unsqueeze(2).expand(B, T, H, dr)), -1)
        k, v = k.transpose(1, 2), kvb[..., dn:].transpose(1, 2)
        s = (q @ k.transpose(-1, -2)) * self.scale
        o = torch.softmax(s.masked_fill(mask[:T, :T], float("-inf")), -1) @ v   # [B, H, T, dv]
        o = o.transpose(1, 2).reshape(B, T, H * dv)
        if self.gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


class Router(nn.Module):
    def __init__(self, dim, c, std):
        super().__init__()
        self.kind, self.n, self.k, self.rho = c.get("router", "sigmoid"), c["n_experts"], c["top_k"], c.get("routed_scaling", 1.0)
        if self.kind == "latent":
            r = c.get("router_rank", 32)
            self.similarity = c.get("similarity", "cosine")
            self.latent_proj = linear(dim, r, std)
            self.expert_vectors = nn.Parameter(torch.randn(self.n, r))
            if self.similarity == "cosine":
                self.log_scale = nn.Parameter(torch.full((1,), math.log(10.0)))
        elif self.kind == "sigmoid":
            self.weight = nn.Parameter(torch.randn(self.n, dim) * std)
        else:
            raise ValueError(f"torch_hybrid: router '{self.kind}' is not written here (sigmoid, latent)")
        # the selection bias: float64 whatever the model dtype, as tide keeps it (nn/moe.lua)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n, dtype=torch.float64))

    def scores(self, x):
        if self.kind == "latent":
            z = self.latent_proj(x)
            e = self.expert_vectors
            logits = z @ e.t()
            if self.similarity == "cosine":
                nz = z.pow(2).sum(1, keepdim=True).sqrt()
                ne = e.pow(2).sum(1, keepdim=True).sqrt().reshape(1, self.n)
                logits = logits * self.log_scale.exp() / (nz * ne + 1e-6)
        else:
            logits = x @ self.weight.t()
        return torch.sigmoid(logits)

    def route(self, s):
        with torch.no_grad():
            sel = torch.topk(s.detach().double() + self.e_score_correction_bias, self.k, dim=1).indices
        ss = s.gather(1, sel)
        return sel, ss * self.rho / (ss.sum(1, keepdim=True) + 1e-20)


class Experts(nn.Module):
    """the routed experts, stored fused as tide does: gate_up_proj [n, 2 d_e, d_in], down_proj [n, d_out, d_e]"""

    def __init__(self, n, d_in, d_e, std, out_std):
        super().__init__()
        self.n, self.d_e = n, d_e
        self.gate_up_proj = nn.Parameter(torch.randn(n, 2 * d_e, d_in) * std)
        self.down_proj = nn.Parameter(torch.randn(n, d_in, d_e) * out_std)

    def forward(self, z, sel, p, activation):
        m, k = sel.shape
        flat = sel.reshape(-1)
        order = torch.argsort(flat, stable=True)      # assignments grouped by expert, in (token, slot) order
        counts = torch.bincount(flat, minlength=self.n).tolist()
        tok = order // k
        zs = z.index_select(0, tok)
        outs, off = [], 0
        for j, c in enumerate(counts):
            if c == 0:
                continue
            gu = zs[off:off + c] @ self.gate_up_proj[j].t()
            g, u = gu[:, :self.d_e], gu[:, self.d_e:]
            h = situ(g, u) if activation == "situ" else F.silu(g) * u
            outs.append(h @ self.down_proj[j].t())
            off += c
        y = torch.cat(outs, 0) * p.reshape(-1).index_select(0, order).unsqueeze(1)
        return torch.zeros(m, y.shape[1], dtype=z.dtype).index_add(0, tok, y)


class MoE(nn.Module):
    def __init__(self, dim, c, activation, std, out_std, eps):
        super().__init__()
        if c.get("balance", "quantile") != "quantile":
            raise ValueError("torch_hybrid: only balance = quantile is written here")
        if c.get("n_group", 1) != 1 or c.get("capacity_factor", 0) != 0:
            raise ValueError("torch_hybrid: group-limited routing and capacity factors are not written here")
        n, k, de = c["n_experts"], c["top_k"], c["expert_dim"]
        self.n, self.k, self.activation = n, k, activation
        self.gate = Router(dim, c, std)
        dl = c.get("latent_dim")
        self.latent = bool(dl)
        d_in = dl if dl else dim
        if dl:
            self.routed_expert_down_proj = linear(dim, dl, std)
        self.experts = Experts(n, d_in, de, std, out_std)
        if dl:
            self.routed_expert_norm = RMSNorm(dl, eps)
            self.routed_expert_up_proj = linear(dl, dim, out_std)
        shared = c.get("shared_dim") or c.get("n_shared", 1) * de
        self.shared_experts = MLP(dim, shared, activation, std, out_std) if shared > 0 else None
        self.records = []

    def forward(self, x):
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        s = self.gate.scores(xf)
        sel, p = self.gate.route(s)
        z = self.routed_expert_down_proj(xf) if self.latent else xf
        y = self.experts(z, sel, p, self.activation)
        if self.latent:
            y = self.routed_expert_up_proj(self.routed_expert_norm(y))
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf)
        if self.training:
            self.records.append(s.detach().double())
        return y.reshape(shape)

    @torch.no_grad()
    def balance_step(self):
        """Quantile Balancing (moe.md §4.1, exact estimator) over the step's routed tokens"""
        if not self.records:
            return
        s = torch.cat(self.records, 0)
        self.records = []
        b = self.gate.e_score_correction_bias
        c = torch.topk(s + b, self.k + 1, dim=1).values[:, self.k:self.k + 1]     # the (k+1)-th largest s + b
        theta = torch.quantile(s - c, 1.0 - self.k / self.n, dim=0, interpolation="linear")
        bh = -theta
        b.copy_(bh - bh.mean())


def attnres(sources, w, nu, eps):
    """sum_i p_i v_i, p = softmax_i(r_i (w * nu) . v_i), r_i = (mean v_i^2 + eps)^-1/2 (attnres.md §1)"""
    V = torch.stack(sources, 0)                                                # [N, ..., d]
    s = (V @ (w.reshape(-1) * nu)) * torch.rsqrt(V.pow(2).mean(-1) + eps)
    p = torch.softmax(s, 0)
    return (p.unsqueeze(-1) * V).sum(0)


class AttnResSite(nn.Module):
    """one mixing site's two parameters, as tide names them: <site>_proj.weight [1, d] (w) and <site>_norm.weight (nu)"""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim))


class Layer(nn.Module):
    def __init__(self, cfg, mixer, l):
        super().__init__()
        d, eps, std = cfg["dim"], cfg.get("norm_eps", 1e-5), cfg.get("init_std", 0.02)
        out_std = std / math.sqrt(2 * cfg["n_layers"])
        self.mixer = mixer
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = KDA(d, cfg["kda"], std, out_std, eps) if mixer == "kda" else MLA(d, cfg["mla"], std, out_std, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        moe = cfg.get("moe")
        if moe and (l > 0 or moe.get("first_dense", True) is False):
            self.block_sparse_moe = MoE(d, moe, cfg["activation"], std, out_std, eps)
        else:
            self.mlp = MLP(d, cfg["ffn_dim"], cfg["activation"], std, out_std)
        self.self_attention_res_proj, self.self_attention_res_norm = AttnResSite(d), RMSNorm(d, eps)
        self.mlp_res_proj, self.mlp_res_norm = AttnResSite(d), RMSNorm(d, eps)

    def ffn(self, x):
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)


class Body(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, eps = cfg["dim"], cfg.get("norm_eps", 1e-5)
        self.eps, self.block_layers = eps, cfg["attnres"]["block_layers"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], d)
        nn.init.normal_(self.embed_tokens.weight, std=cfg.get("init_std", 0.02))
        self.layers = nn.ModuleList([Layer(cfg, m, l) for l, m in enumerate(cfg["schedule"])])
        self.output_attn_res_proj, self.output_attn_res_norm = AttnResSite(d), RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)

    def mix(self, proj, norm, sources):
        return attnres(sources, proj.weight, norm.weight, self.eps)

    def forward(self, ids, mask):
        # Block AttnRes (attnres.md §3): blocks = the embedding and one sum per completed block, prefix = the running
        # sum of the current block's sublayer outputs
        blocks, prefix = [], self.embed_tokens(ids)
        for l, layer in enumerate(self.layers):
            h = self.mix(layer.self_attention_res_proj, layer.self_attention_res_norm, blocks + [prefix]) if blocks else prefix
            if l % self.block_layers == 0:
                blocks.append(prefix)
                prefix = None
            xn = layer.input_layernorm(h)
            m = layer.self_attn(xn) if layer.mixer == "kda" else layer.self_attn(xn, mask)
            prefix = m if prefix is None else prefix + m
            h = self.mix(layer.mlp_res_proj, layer.mlp_res_norm, blocks + [prefix])
            prefix = prefix + layer.ffn(layer.post_attention_layernorm(h))
        return self.norm(self.mix(self.output_attn_res_proj, self.output_attn_res_norm, blocks + [prefix]))


class HybridLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.get("residual", "attnres_block") != "attnres_block":
            raise ValueError("torch_hybrid: only residual = attnres_block is written here")
        self.model = Body(cfg)
        self.lm_head = linear(cfg["dim"], cfg["vocab_size"], cfg.get("init_std", 0.02))
        self.mask = torch.ones(0, 0, dtype=torch.bool)

    def forward(self, ids, targets):
        T = ids.shape[1]
        if self.mask.shape[0] < T:     # the causal mask (True above the diagonal: masked), made once per length
            self.mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        logits = self.lm_head(self.model(ids, self.mask))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def moe_layers(self):
        return [l.block_sparse_moe for l in self.model.layers if hasattr(l, "block_sparse_moe")]

    def balance_step(self):
        for m in self.moe_layers():
            m.balance_step()


def no_decay(name, p):
    """tide's groups (optim.md §1): 1-D never decays; these matrices neither"""
    return (p.dim() < 2 or name.startswith("model.embed_tokens.") or "_conv1d." in name or "_res_proj." in name
            or name.endswith("expert_vectors"))


def build(path, dtype):
    """the model of a tide file, its weights loaded; -> model, tensors, metadata"""
    ts, meta = read_safetensors(path)
    cfg = json.loads(meta["config"])
    dt = {"f32": torch.float32, "f64": torch.float64}[dtype]
    torch.manual_seed(1)
    model = HybridLM(cfg).to(dt)
    for m in model.moe_layers():       # the bias stays float64 (Router)
        m.gate.e_score_correction_bias.data = m.gate.e_score_correction_bias.data.double()
    state = dict(model.named_parameters())
    missing = [n for n in state if n not in ts]
    extra = [n for n in ts if not n.startswith(("input.", "tide.")) and n not in state and
             not n.endswith("e_score_correction_bias")]
    if missing or extra:
        raise ValueError(f"{path}: parameters differ from tide's: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for n, p in state.items():
            if tuple(p.shape) != tuple(ts[n].shape):
                raise ValueError(f"{path}: {n} is {tuple(ts[n].shape)} in the file, {tuple(p.shape)} here")
            p.copy_(ts[n].to(dt))
        for name, b in model.named_buffers():
            if name in ts:
                b.copy_(ts[name].to(b.dtype))
    return model, ts, meta


def adamw(model, meta):
    o = json.loads(meta["optim"])
    decay = [p for n, p in model.named_parameters() if not no_decay(n, p)]
    rest = [p for n, p in model.named_parameters() if no_decay(n, p)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]}, {"params": rest, "weight_decay": 0.0}],
                             lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], foreach=True), o


def train_step(model, opt, clip, ids, targets):
    loss = model(ids, targets)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.balance_step()
    return loss.item(), (float(norm) if norm is not None else None)


def check(path, steps=0):
    """tide's loss and gradients at tide's weights on tide's batch, against this model's (see the top)"""
    _, meta0 = read_safetensors(path)
    dtype = meta0.get("dtype", "f32")
    model, ts, meta = build(path, dtype)
    model.train()
    ids, targets = ts["input.ids"].long(), ts["input.targets"].long()
    loss = model(ids, targets)
    loss.backward()
    out = {"framework": "pytorch " + torch.__version__, "dtype": dtype, "loss": loss.item()}
    tl = ts.get("tide.loss")
    if tl is not None:
        out["tide_loss"] = float(tl.reshape(-1)[0])
        out["loss_rel_delta"] = abs(out["loss"] - out["tide_loss"]) / abs(out["tide_loss"])
    sq, tsq, worst, worst_name, worst_abs, compared = 0.0, 0.0, 0.0, None, 0.0, 0
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        sq += float(g.double().pow(2).sum())
        tg = ts.get("tide.grad." + n)
        if tg is None:
            continue
        tg = tg.double()
        tsq += float(tg.pow(2).sum())
        d = float((g.double() - tg).abs().max())
        scale = float(tg.abs().max())
        rel = d / scale if scale > 0 else d
        compared += 1
        if rel > worst:
            worst, worst_name = rel, n
        worst_abs = max(worst_abs, d)
    out["grad_norm"] = math.sqrt(sq)
    if compared:
        out["tide_grad_norm"] = math.sqrt(tsq)
        out["grad_norm_rel_delta"] = abs(out["grad_norm"] - out["tide_grad_norm"]) / out["tide_grad_norm"]
        out["grads_compared"] = compared
        out["grad_max_rel_delta"], out["grad_worst"], out["grad_max_abs_delta"] = worst, worst_name, worst_abs
    out["params"] = sum(p.numel() for p in model.parameters())
    out["no_decay"] = sorted(n for n, p in model.named_parameters() if no_decay(n, p))
    if steps > 0:
        model.zero_grad(set_to_none=True)
        for m in model.moe_layers():
            m.records = []
        opt, o = adamw(model, meta)
        losses, norms = [], []
        for _ in range(steps):
            lo, nr = train_step(model, opt, o.get("clip"), ids, targets)
            losses.append(lo)
            norms.append(nr)
        out["train_losses"], out["train_grad_norms"] = losses, norms
        out["bias_after"] = [m.gate.e_score_correction_bias.tolist() for m in model.moe_layers()]
    return out


class Timer:
    """the --serve timing state: one model, its optimiser and its batch"""

    def __init__(self, path, warmup):
        self.model, ts, meta = build(path, "f32")
        self.model.train()
        self.opt, o = adamw(self.model, meta)
        self.clip = o.get("clip")
        self.ids, self.targets = ts["input.ids"].long(), ts["input.targets"].long()
        self.steps(warmup)

    def steps(self, n):
        times, losses = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            loss, _ = train_step(self.model, self.opt, self.clip, self.ids, self.targets)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
        return {"step_s": times, "losses": losses}


def serve(a):
    info = {"framework": "pytorch " + torch.__version__, "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}
    state = {"timer": None}

    def handle(c):
        cmd = c.get("cmd")
        if cmd == "info":
            return info
        if cmd == "check":
            return check(c["path"], int(c.get("steps", 0)))
        if cmd == "setup":
            state["timer"] = None
            state["timer"] = Timer(c["path"], int(c.get("warmup", 1)))
            return {"ok": True, "params": sum(p.numel() for p in state["timer"].model.parameters())}
        if cmd == "steps":
            if state["timer"] is None:
                raise RuntimeError("steps before setup")
            return state["timer"].steps(int(c.get("n", 1)))
        return {"error": "unknown command " + repr(cmd)}

    serve_fifo(a.serve, handle)

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", default="", help="a safetensors file of bench/hybrid.lua: compare with tide's loss and gradients")
    p.add_argument("--steps", type=int, default=0, help="with --check: training steps from the file's weights")
    p.add_argument("--serve", default="", help="FIFO: answer JSON commands read from it (see the top of the file)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = p.parse_args()
    if a.threads < 1 or a.steps < 0:
        p.error("threads must be >= 1 and steps >= 0")
    torch.set_num_threads(a.threads)
    if a.serve:
        return serve(a)
    if not a.check:
        p.error("give --check FILE or --serve FIFO")
    json.dump(check(a.check, a.steps), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
