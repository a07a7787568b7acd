#!/usr/bin/env python3
"""The tokenizers library's side of tide's BPE comparisons (tests/lua/test_bpe*.lua, bench/tokenizer.lua).

  hf_tokenize.py encode JOBS_JSON OUT_DIR
      JOBS_JSON is a list of {"tokenizer": tokenizer.json, "input": text file, "split": null or a separator}.
      For job k: OUT_DIR/k.ids the ids (uint32 LE) of encode(text, add_special_tokens=False), or with a separator
      of each document of text.split(separator) in order (encode_batch, on all cores); OUT_DIR/k.counts the ids
      per document (uint32 LE); OUT_DIR/k.txt decode(all the ids, skip_special_tokens=False) as UTF-8.
  hf_tokenize.py bench TOKENIZER_JSON INPUT REPEATS
      one-thread encode throughput of INPUT as one text and as its lines (encode_batch): prints
      "bytes whole_seconds lines_seconds", each the best of REPEATS
Prints "ok tokenizers <version>" last on success.
"""
import json
import os
import struct
import sys
import time

if len(sys.argv) > 1 and sys.argv[1] == "bench":
    os.environ["RAYON_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402


def u32(values):
    return struct.pack(f"<{len(values)}I", *values)


def encode(jobs_path, out_dir):
    with open(jobs_path) as f:
        jobs = json.load(f)
    cache = {}
    for k, job in enumerate(jobs):
        tok = cache.get(job["tokenizer"]) or cache.setdefault(job["tokenizer"], Tokenizer.from_file(job["tokenizer"]))
        with open(job["input"], "rb") as f:
            text = f.read().decode("utf-8")
        docs = text.split(job["split"]) if job.get("split") else [text]
        encs = tok.encode_batch(docs, add_special_tokens=False) if len(docs) > 1 else \
            [tok.encode(docs[0], add_special_tokens=False)]
        ids, counts = [], []
        for e in encs:
            ids.extend(e.ids)
            counts.append(len(e.ids))
        with open(os.path.join(out_dir, f"{k}.ids"), "wb") as f:
            f.write(u32(ids))
        with open(os.path.join(out_dir, f"{k}.counts"), "wb") as f:
            f.write(u32(counts))
        with open(os.path.join(out_dir, f"{k}.txt"), "wb") as f:
            f.write(tok.decode(ids, skip_special_tokens=False).encode("utf-8"))


def best_of(repeats, fn):
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = dt if best is None or dt < best else best
    return best


def bench(tok_path, path, repeats):
    tok = Tokenizer.from_file(tok_path)
    with open(path, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    lines = text.split("\n")
    whole = best_of(repeats, lambda: tok.encode(text, add_special_tokens=False))
    by_line = best_of(repeats, lambda: tok.encode_batch(lines, add_special_tokens=False))
    print(len(raw), whole, by_line)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "encode":
        encode(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 5 and sys.argv[1] == "bench":
        bench(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(__doc__)
    print("ok tokenizers", tokenizers.__version__)


if __name__ == "__main__":
    main()
