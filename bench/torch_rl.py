#!/usr/bin/python3
"""torch_rl.py — the baseline of bench/rl.lua: the hybrid KDA/MLA model of recipes/agent_rl.lua written in PyTorch
eager on the CPU (a simple reference for the benchmark: the same shapes, its own random weights), with the same
decode loop (G rows sampled per prompt, a calc tool call answered by appending its result tokens) and the same
update (per-token log-probs over the padded batch, the GRPO surrogate with the k3 KL and TIS weights, backward,
gradient clipping, AdamW).

The model, as lua/tide/nn/hybrid.lua, kda.lua, mla.lua (spec/kda.md §1-§3, spec/mla.md):
  embedding; per layer x += mixer(RMSNorm(x)); x += SwiGLU(RMSNorm(x)); final RMSNorm; lm_head (untied).
  KDA: q/k/v/g projections; depthwise causal conv (width 4, a cache of the last 3 pre-conv inputs) + SiLU on q, k, v;
    L2-normalised q (times dk^-1/2) and k; beta = sigmoid(b_proj x) per head; the lower-bounded decay gate
    g = -5 sigmoid(exp(A_log) (f_b(f_a x) + dt_bias)); per token (kda.md §3): S <- diag(exp g) S;
    u = beta (v - S^T k); S <- S + k u^T; o = S^T q; per-head RMSNorm over dv; sigmoid(g_proj x) gate; o_proj.
  MLA (NoPE; the rope slot is scored, never rotated): q = q_b(RMSNorm(q_a x)); [c | k_r] = kv_a x, c RMSNorm'd and
    cached; decode attends over the latent cache absorbed (mla.md §6: q~ = W_UK^T q_n, scores q~.c + q_r.k_r,
    o = W_UV (p c)); prefill and training expand the cache through kv_b and attend causally; sigmoid output gate;
    o_proj. scale = (nope + rope)^-1/2.
Decode loop (batched across the G rows of a prompt; the prompts one after another): the prompt is prefilled once
(B = 1) and its caches copied to the G rows; each step feeds one token per row: the token it sampled, or, after a
<|tool_call_end|>, the next token of the tool's answer <|tool_result_begin|>TEXT<|tool_result_end|> (TEXT is the
exact value of a `calc: EXPR` call, else an error line). A row ends at <|im_end|> or <|endoftext|>, at max_new
sampled tokens, or at a call beyond max_turns; ended rows are dropped from the batch (their cache rows selected out).
Every row advances one position per step, so the caches of the batch keep one length and need no padding.
The training forward runs KDA as a naive per-token loop over L (batched over B, under autograd): a simple reference,
not a chunked kernel.

  torch_rl.py --serve FIFO   one JSON command per line from FIFO, one JSON line back on stdout:
      {"cmd": "rollout", "prompts": [[ids]], "G", "max_new", "max_turns", "temperature", "seed", "threads",
       "specials": {...}}  -> {"tokens", "wall_s", "steps", "tool_calls", "rows"}
      {"cmd": "update", "lengths": [...], "prompt_lens": [...], "G", "threads", "seed"}
          -> {"score_s" (two no-grad scorings: reference and TIS), "update_s" (forward, GRPO, backward, clip,
              AdamW), "B", "L", "n_targets"}
      {"cmd": "quit"}
Run with OMP_WAIT_POLICY=PASSIVE.
"""
import argparse
import json
import math
import re
import sys
import time
from fractions import Fraction

import torch
import torch.nn.functional as F

CFG = dict(vocab=320, dim=64, layers="KMKM", ffn=192, kda_heads=2, kda_dk=32, conv=4, lb=-5.0,
           mla_heads=2, q_rank=48, kv_rank=32, nope=32, rope=16, v_dim=32, eps=1e-5)


def rms(x, w, eps=CFG["eps"]):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def lin(i, o):
    return (torch.randn(o, i) * 0.02).requires_grad_(True)


class Model:
    def __init__(self, seed=0):
        torch.manual_seed(seed)
        c = CFG
        d, V = c["dim"], c["vocab"]
        self.p = {"embed": (torch.randn(V, d) * 0.02).requires_grad_(True), "norm": torch.ones(d).requires_grad_(True),
                  "lm_head": lin(d, V)}
        self.kinds = list(c["layers"])
        for l, kind in enumerate(self.kinds):
            P = {"n0": torch.ones(d), "n1": torch.ones(d), "ffn_g": lin(d, c["ffn"]), "ffn_u": lin(d, c["ffn"]),
                 "ffn_d": lin(c["ffn"], d)}
            if kind == "K":
                H, dk = c["kda_heads"], c["kda_dk"]
                inner = H * dk
                for n in ("q", "k", "v", "g"):
                    P[n] = lin(d, inner)
                P["o"] = lin(inner, d)
                for n in ("qc", "kc", "vc"):
                    P[n] = torch.randn(inner, 1, c["conv"]) * 0.02
                P["fa"], P["fb"], P["b"] = lin(d, dk), lin(dk, inner), lin(d, H)
                P["A_log"] = torch.zeros(H)
                P["dt_bias"] = torch.rand(inner) * 0.1
                P["onorm"] = torch.ones(dk)
            else:
                H = c["mla_heads"]
                P["qa"], P["qan"], P["qb"] = lin(d, c["q_rank"]), torch.ones(c["q_rank"]), lin(c["q_rank"], H * (c["nope"] + c["rope"]))
                P["kva"], P["kvan"] = lin(d, c["kv_rank"] + c["rope"]), torch.ones(c["kv_rank"])
                P["kvb"] = lin(c["kv_rank"], H * (c["nope"] + c["v_dim"]))
                P["g"], P["o"] = lin(d, H * c["v_dim"]), lin(H * c["v_dim"], d)
            for k, v in P.items():
                v.requires_grad_(True)
                self.p["l%d.%s" % (l, k)] = v
        self.params = list(self.p.values())

    # ---- KDA over x [B, T, d] from cache {S [B,H,dk,dv], conv {q,k,v} [B, K-1, inner]} (None: zeros) ----
    def kda(self, l, x, cache):
        c, P = CFG, lambda n: self.p["l%d.%s" % (l, n)]
        B, T, _ = x.shape
        H, dk = c["kda_heads"], c["kda_dk"]
        inner, K1 = H * dk, c["conv"] - 1
        if cache.get("S") is None:
            cache["S"] = x.new_zeros(B, H, dk, dk)
            cache["conv"] = {n: x.new_zeros(B, K1, inner) for n in "qkv"}

        def conv(n):
            pre = x @ P(n).t()
            full = torch.cat([cache["conv"][n], pre], 1)                    # [B, K-1+T, inner]
            cache["conv"][n] = full[:, -K1:]
            y = F.conv1d(full.transpose(1, 2), P(n + "c"), groups=inner)     # [B, inner, T]
            return F.silu(y.transpose(1, 2)).reshape(B, T, H, dk)
        q = F.normalize(conv("q"), dim=-1, eps=1e-6) / math.sqrt(dk)
        k = F.normalize(conv("k"), dim=-1, eps=1e-6)
        v = conv("v")
        beta = torch.sigmoid(x @ P("b").t())                                 # [B, T, H]
        z = ((x @ P("fa").t()) @ P("fb").t()).reshape(B, T, H, dk)
        g = c["lb"] * torch.sigmoid(torch.exp(P("A_log")).view(1, 1, H, 1) * (z + P("dt_bias").view(1, 1, H, dk)))
        a = torch.exp(g)
        S = cache["S"]
        outs = []
        for t in range(T):                                                   # kda.md §3, per token
            S = a[:, t].unsqueeze(-1) * S
            kt = k[:, t]
            u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
            S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
            outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
        cache["S"] = S
        o = torch.stack(outs, 1)                                             # [B, T, H, dv]
        y = rms(o, P("onorm")) * torch.sigmoid(x @ P("g").t()).reshape(B, T, H, dk)
        return y.reshape(B, T, inner) @ P("o").t()

    # ---- MLA over x [B, T, d] with a latent cache {c [B, Tc, dc], kr [B, Tc, dr]} ----
    def mla(self, l, x, cache):
        c, P = CFG, lambda n: self.p["l%d.%s" % (l, n)]
        B, T, _ = x.shape
        H, dn, dr, dc, dv = c["mla_heads"], c["nope"], c["rope"], c["kv_rank"], c["v_dim"]
        scale = 1 / math.sqrt(dn + dr)
        q = (rms(x @ P("qa").t(), P("qan")) @ P("qb").t()).reshape(B, T, H, dn + dr)
        kv = x @ P("kva").t()
        cn, kr = rms(kv[..., :dc], P("kvan")), kv[..., dc:]
        if cache.get("c") is not None:
            cn, kr = torch.cat([cache["c"], cn], 1), torch.cat([cache["kr"], kr], 1)
        cache["c"], cache["kr"] = cn, kr
        Tc = cn.shape[1]
        if T == 1:   # absorbed decode
            w = P("kvb").reshape(H, dn + dv, dc)
            qt = torch.einsum("bhn,hnc->bhc", q[:, 0, :, :dn], w[:, :dn])
            s = torch.einsum("bhc,btc->bht", qt, cn) + torch.einsum("bhr,btr->bht", q[:, 0, :, dn:], kr)
            p = torch.softmax(s * scale, -1)
            o = torch.einsum("bhc,hvc->bhv", torch.einsum("bht,btc->bhc", p, cn), w[:, dn:]).reshape(B, 1, H * dv)
        else:        # expanded, causal over the cache
            kvb = (cn @ P("kvb").t()).reshape(B, Tc, H, dn + dv)
            kn, v = kvb[..., :dn], kvb[..., dn:]
            s = torch.einsum("bqhn,bkhn->bhqk", q[..., :dn], kn) + torch.einsum("bqhr,bkr->bhqk", q[..., dn:], kr)
            off = Tc - T
            mask = torch.ones(T, Tc, dtype=torch.bool).triu(off + 1)
            p = torch.softmax((s * scale).masked_fill(mask, float("-inf")), -1)
            o = torch.einsum("bhqk,bkhv->bqhv", p, v).reshape(B, T, H * dv)
        o = o * torch.sigmoid(x @ P("g").t())
        return o @ P("o").t()

    def forward(self, ids, caches):
        x = self.p["embed"][ids]
        for l, kind in enumerate(self.kinds):
            P = lambda n: self.p["l%d.%s" % (l, n)]
            h = rms(x, P("n0"))
            x = x + (self.kda(l, h, caches[l]) if kind == "K" else self.mla(l, h, caches[l]))
            h = rms(x, P("n1"))
            x = x + (F.silu(h @ P("ffn_g").t()) * (h @ P("ffn_u").t())) @ P("ffn_d").t()
        return rms(x, self.p["norm"]) @ self.p["lm_head"].t()


def select_rows(caches, idx):
    out = []
    for cch in caches:
        n = {}
        for k, v in cch.items():
            n[k] = {a: b.index_select(0, idx) for a, b in v.items()} if isinstance(v, dict) else v.index_select(0, idx)
        out.append(n)
    return out


def expand_rows(caches, G):
    out = []
    for cch in caches:
        n = {}
        for k, v in cch.items():
            n[k] = ({a: b.expand(G, *b.shape[1:]).contiguous() for a, b in v.items()} if isinstance(v, dict)
                    else v.expand(G, *v.shape[1:]).contiguous())
        out.append(n)
    return out


# ---- the calc tool: the exact value of an integer expression with + - * / and parentheses, else an error ----
def calc(text):
    m = re.match(r"^\s*calc\s*:\s*(.*)$", text, re.S)
    if not m:
        return "error: malformed call"
    s = m.group(1)
    toks = re.findall(r"\d+|[-+*/()]|\S", s)
    pos = [0]

    def peek():
        return toks[pos[0]] if pos[0] < len(toks) else None

    def factor():
        t = peek()
        pos[0] += 1
        if t is None:
            raise ValueError
        if t == "(":
            v = expr()
            if peek() != ")":
                raise ValueError
            pos[0] += 1
            return v
        if t.isdigit():
            return Fraction(int(t))
        raise ValueError

    def term():
        v = factor()
        while peek() in ("*", "/"):
            op = toks[pos[0]]
            pos[0] += 1
            w = factor()
            v = v * w if op == "*" else v / w
        return v

    def expr():
        v = term()
        while peek() in ("+", "-"):
            op = toks[pos[0]]
            pos[0] += 1
            w = term()
            v = v + w if op == "+" else v - w
        return v
    try:
        v = expr()
        if pos[0] != len(toks):
            return "error"
    except (ValueError, ZeroDivisionError):
        return "error"
    return str(v.numerator) if v.denominator == 1 else "%d/%d" % (v.numerator, v.denominator)


def rollout(model, cmd):
    sp = cmd["specials"]
    G, max_new, max_turns = cmd["G"], cmd["max_new"], cmd["max_turns"]
    temp = cmd["temperature"]
    gen = torch.Generator().manual_seed(cmd["seed"])
    stops = (sp["im_end"], sp["eos"])
    tokens = steps = calls_total = rows = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for prompt in cmd["prompts"]:
            caches = [{} for _ in model.kinds]
            logits = model.forward(torch.tensor([prompt]), caches)[:, -1]
            caches = expand_rows(caches, G)
            logits = logits.expand(G, -1)
            rows += G
            # per live row: its sampled and fed tokens, the forced tokens still to feed, counts
            live = [{"toks": [], "queue": [], "n_new": 0, "calls": 0} for _ in range(G)]
            while live:
                # sample every row (rows that feed a forced token ignore theirs)
                probs = torch.softmax(logits / temp, -1)
                ids = torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()
                logp = torch.log_softmax(logits, -1)   # logp_old at temperature 1, as tide records it
                nxt, keep = [], []
                for i, r in enumerate(live):
                    if r["queue"]:
                        nxt.append(r["queue"].pop(0))
                        keep.append(i)
                        continue
                    tid = ids[i]
                    r["toks"].append((tid, float(logp[i, tid])))
                    r["n_new"] += 1
                    tokens += 1
                    if tid == sp["call_end"]:
                        r["calls"] += 1
                        calls_total += 1
                        if r["calls"] >= max_turns or r["n_new"] >= max_new:
                            continue
                        # the call's text: from its <|tool_call_begin|>
                        seq = [t for t, _ in r["toks"]]
                        b = max((j for j, t in enumerate(seq) if t == sp["call_begin"]), default=None)
                        text = (bytes(t for t in seq[b + 1:-1] if t < 256).decode("latin-1") if b is not None else "")
                        res = calc(text) if b is not None else "error: malformed call"
                        r["queue"] = [sp["result_begin"]] + list(res.encode("latin-1")) + [sp["result_end"]]
                        nxt.append(tid)
                        keep.append(i)
                    elif tid in stops or r["n_new"] >= max_new:
                        continue
                    else:
                        nxt.append(tid)
                        keep.append(i)
                if not keep:
                    break
                if len(keep) < len(live):
                    idx = torch.tensor(keep)
                    caches = select_rows(caches, idx)
                    live = [live[i] for i in keep]
                logits = model.forward(torch.tensor(nxt).unsqueeze(1), caches)[:, -1]
                steps += 1
    return {"tokens": tokens, "wall_s": time.perf_counter() - t0, "steps": steps, "tool_calls": calls_total,
            "rows": rows}


def token_logp(model, ids, targets):
    logits = model.forward(ids, [{} for _ in model.kinds])
    return torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def update(model, opt, cmd):
    lengths, plens, G = cmd["lengths"], cmd["prompt_lens"], cmd["G"]
    B, L = len(lengths), max(lengths) - 1
    g = torch.Generator().manual_seed(cmd["seed"])
    ids = torch.randint(0, 256, (B, L + 1), generator=g)
    mask = torch.zeros(B, L)
    for r, (n, p) in enumerate(zip(lengths, plens)):
        mask[r, p - 1:n - 1] = 1        # targets p+1 .. n (1-based): the sampled tokens
    x, y = ids[:, :L], ids[:, 1:]
    rewards = (torch.rand(B, generator=g) < 0.5).float()
    t0 = time.perf_counter()
    with torch.no_grad():                              # the reference's and the TIS recomputation's scores
        logp_ref = token_logp(model, x, y)
        logp_train = token_logp(model, x, y)
    t1 = time.perf_counter()
    logp_old = logp_train + 0.01 * torch.randn(B, L, generator=g)      # the sampler's, a little off
    tis = torch.exp(logp_train - logp_old).clamp(max=2.0)
    r = rewards.view(-1, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).view(B, 1)
    logp = token_logp(model, x, y)
    ratio = torch.exp(logp - logp_train)
    surr = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    xk = logp_ref - logp
    kl = torch.exp(xk) - xk - 1
    per_tok = tis * (surr - 0.04 * kl) * mask
    J = (per_tok.sum(1) / mask.sum(1).clamp(min=1)).sum() / G
    loss = -J
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.params, 1.0)
    opt.step()
    opt.zero_grad()
    t2 = time.perf_counter()
    return {"score_s": t1 - t0, "update_s": t2 - t1, "B": B, "L": L, "n_targets": int(mask.sum()),
            "loss": float(loss)}


def serve(path):
    model = Model(0)
    opt = torch.optim.AdamW(model.params, lr=3e-4, weight_decay=0.0)
    with open(path, "r") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                cmd = json.loads(line)
                if cmd["cmd"] == "quit":
                    print(json.dumps({"ok": True}), flush=True)
                    return
                torch.set_num_threads(int(cmd.get("threads", 1)))
                if cmd["cmd"] == "rollout":
                    out = rollout(model, cmd)
                elif cmd["cmd"] == "update":
                    out = update(model, opt, cmd)
                elif cmd["cmd"] == "version":
                    out = {"framework": "PyTorch " + torch.__version__}
                else:
                    out = {"error": "unknown command " + cmd["cmd"]}
                out["threads"] = torch.get_num_threads()
            except Exception as e:  # noqa: BLE001 - the error goes back to the bench
                out = {"error": "%s: %s" % (type(e).__name__, e)}
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", required=True)
    serve(ap.parse_args().serve)
