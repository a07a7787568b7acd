#!/usr/bin/env python3
"""agent_rl report: the learning gate of spec/rl.md oracle 10 from agent_rl runs' metrics.jsonl.

  python3 bench/agent_rl_report.py --run grpo=RUN_DIR --run dapo=RUN_DIR [--wall grpo=SECONDS ...]
      [--kv RUN_DIR [--kv-wall SECONDS]] [--md bench/results/agent_rl.md] [--json bench/results/agent_rl.json]

Gate, per objective: the format rate reaches >= 0.9 within 50 iterations, and the mean reward of iterations 31-50
exceeds that of iterations 1-20. kv_search (recipes/agent_kv_search.lua, --kv): the reward rises, read as the mean
reward of the last quarter of the iterations above that of the first quarter. The recipe's config and seed are read
from each run's config.json.
"""
import argparse
import json
import os

COLS = [("iteration", "iter", "%d"), ("reward_mean", "reward", "%.3f"), ("format_rate", "format", "%.3f"),
        ("accuracy", "acc", "%.3f"), ("response_len", "len", "%.1f"), ("entropy", "entropy", "%.3f"),
        ("loss", "loss", "%.4f")]


def load(run):
    sft, rl = [], []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            (rl if r.get("phase") == "rl" else sft).append(r)
    # a resumed run may repeat records: the last one of each iteration counts
    by_it = {}
    for r in rl:
        by_it[r["iteration"]] = r
    cfg = None
    p = os.path.join(run, "config.json")
    if os.path.exists(p):
        with open(p) as f:
            cfg = json.load(f)
    return sft, [by_it[k] for k in sorted(by_it)], cfg


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def gate(rl):
    its = {r["iteration"]: r for r in rl}
    first = [its[i]["reward_mean"] for i in range(1, 21) if i in its]
    last = [its[i]["reward_mean"] for i in range(31, 51) if i in its]
    fmt_hits = [i for i in range(1, 51) if i in its and its[i]["format_rate"] >= 0.9]
    g = {"iterations": len(rl), "reward_mean_1_20": mean(first), "reward_mean_31_50": mean(last),
         "accuracy_mean_1_20": mean([its[i]["accuracy"] for i in range(1, 21) if i in its]),
         "accuracy_mean_31_50": mean([its[i]["accuracy"] for i in range(31, 51) if i in its]),
         "format_rate_max": max((its[i]["format_rate"] for i in range(1, 51) if i in its), default=float("nan")),
         "first_iteration_format_ge_0_9": fmt_hits[0] if fmt_hits else None}
    g["format_ok"] = bool(fmt_hits)
    g["reward_rises"] = len(first) == 20 and len(last) == 20 and g["reward_mean_31_50"] > g["reward_mean_1_20"]
    g["pass"] = g["format_ok"] and g["reward_rises"]
    return g


KV_COLS = [("iteration", "iter", "%d"), ("reward_mean", "reward", "%.4f"), ("accuracy", "values right", "%.3f"),
           ("tool_calls_per_sample", "calls", "%.2f"), ("malformed_calls", "malformed", "%d"),
           ("truncated_rate", "truncated", "%.2f"), ("response_len", "len", "%.1f"), ("entropy", "entropy", "%.3f")]


def kv_gate(rl):
    n = len(rl)
    q = max(n // 4, 1)
    first = [r["reward_mean"] for r in rl[:q]]
    last = [r["reward_mean"] for r in rl[-q:]]
    def var(xs):
        m = mean(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else float("nan")
    g = {"iterations": n, "quarter": q, "reward_mean_first": mean(first), "reward_mean_last": mean(last)}
    # the rise must clear twice its standard error (iteration means as samples), not just be positive
    g["rise"] = g["reward_mean_last"] - g["reward_mean_first"]
    g["rise_se"] = ((var(first) + var(last)) / q) ** 0.5 if q > 1 else float("nan")
    g["reward_rises"] = n >= 8 and g["rise"] > 2 * g["rise_se"]
    return g


def cell(r, key, f):
    v = r.get(key)
    return "-" if v is None else f % v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", default=[], help="OBJECTIVE=RUN_DIR")
    ap.add_argument("--wall", action="append", default=[], help="OBJECTIVE=SECONDS (the whole run, SFT included)")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    ap.add_argument("--kv", help="a recipes/agent_kv_search.lua run directory")
    ap.add_argument("--kv-wall", type=float, help="its wall time in seconds (SFT included)")
    ap.add_argument("--kv-note", action="append", default=[], help="a line for the kv_search notes")
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args()
    walls = dict(w.split("=", 1) for w in a.wall)
    out = {"gate": "spec/rl.md oracle 10: format rate >= 0.9 within 50 iterations, and mean reward of iterations "
                   "31-50 above iterations 1-20", "objectives": {}}
    md = ["# agent_rl: the RL learning gate (spec/rl.md oracle 10)", "",
          "Recipe `recipes/agent_rl.lua`: SFT warm-up on countdown demonstrations, then 50 RL iterations on "
          "countdown with the calc tool. Gate: format rate >= 0.9 within 50 iterations, and the mean reward of "
          "iterations 31-50 above that of iterations 1-20, for GRPO and for DAPO.", ""]
    summary = ["| objective | format rate >= 0.9 first at | max format rate | reward 1-20 | reward 31-50 | "
               "accuracy 1-20 | accuracy 31-50 | wall time | gate |", "|---|---|---|---|---|---|---|---|---|"]
    tables = []
    cfg0 = None
    for spec in a.run:
        name, run = spec.split("=", 1)
        sft, rl, cfg = load(run)
        cfg0 = cfg0 or cfg
        g = gate(rl)
        wall = float(walls[name]) if name in walls else None
        g["wall_s"] = wall
        g["sft_final_loss"] = sft[-1]["loss"] if sft else None
        g["rl_time_s"] = sum((r.get("t_sample") or 0) + (r.get("t_update") or 0) for r in rl)
        out["objectives"][name] = {"gate": g, "iterations": [{k: r.get(k) for k, _, _ in COLS} for r in rl]}
        summary.append("| %s | %s | %.3f | %.4f | %.4f | %.4f | %.4f | %s | %s |" % (
            name, g["first_iteration_format_ge_0_9"] or "never", g["format_rate_max"], g["reward_mean_1_20"],
            g["reward_mean_31_50"], g["accuracy_mean_1_20"], g["accuracy_mean_31_50"],
            "%.0f s" % wall if wall else "-", "PASS" if g["pass"] else "FAIL"))
        t = ["### %s" % name, "", "| " + " | ".join(h for _, h, _ in COLS) + " |",
             "|" + "---|" * len(COLS)]
        for r in rl:
            t.append("| " + " | ".join(cell(r, k, f) for k, _, f in COLS) + " |")
        tables += t + [""]
    if cfg0:
        keep = {k: cfg0.get(k) for k in ("model", "sft", "rl", "optim", "train", "seed", "threads") if k in cfg0}
        # one config for every run: only rl.objective differs (it names each table below)
        keep["rl"] = dict(keep.get("rl") or {}, objective=" | ".join(n.split("=", 1)[0] for n in a.run))
        keep["seed"] = cfg0.get("seed", (cfg0.get("train") or {}).get("seed", 0))
        out["config"] = keep
        md += ["## Config", "", "```json", json.dumps(keep, indent=1, sort_keys=True), "```", ""]
    md += ["## Gate", ""] + summary + [""]
    if a.note:
        md += ["## Notes", ""] + ["- " + n for n in a.note] + [""]
        out["notes"] = a.note
    if a.kv:
        sft, rl, cfg = load(a.kv)
        g = kv_gate(rl)
        g["wall_s"] = a.kv_wall
        g["sft_final_loss"] = sft[-1]["loss"] if sft else None
        out["kv_search"] = {"gate": g, "config": cfg, "iterations": [{k: r.get(k) for k, _, _ in KV_COLS} for r in rl]}
        md += ["## kv_search", "",
               "Recipe `recipes/agent_kv_search.lua` (multi-turn `search` calls, credit per turn, GRPO). Gate: the "
               "reward rises: the mean reward of the last quarter of the iterations above the first quarter's by more "
               "than twice the standard error of that difference (iteration means as samples).", "",
               "| iterations | SFT final loss | reward, first %d | reward, last %d | rise (2 s.e.) | wall time | gate |" % (g["quarter"], g["quarter"]),
               "|---:|---:|---:|---:|---:|---|---|",
               "| %d | %s | %.4f | %.4f | %.4f (%.4f) | %s | %s |" % (g["iterations"], "%.4f" % g["sft_final_loss"] if g["sft_final_loss"] is not None else "-",
                                                     g["reward_mean_first"], g["reward_mean_last"], g["rise"], 2 * g["rise_se"],
                                                     "%.0f s" % a.kv_wall if a.kv_wall else "-",
                                                     "PASS" if g["reward_rises"] else "FAIL"), ""]
        if a.kv_note:
            md += ["- " + n for n in a.kv_note] + [""]
            out["kv_search"]["notes"] = a.kv_note
        t = ["| " + " | ".join(h for _, h, _ in KV_COLS) + " |", "|" + "---|" * len(KV_COLS)]
        for r in rl:
            t.append("| " + " | ".join(cell(r, k, f) for k, _, f in KV_COLS) + " |")
        md += t + [""]
    md += ["## Per iteration", ""] + tables
    text = "\n".join(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    else:
        print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
