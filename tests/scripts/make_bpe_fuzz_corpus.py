#!/usr/bin/env python3
"""Writes the seed corpus of tests/fuzz/fuzz_bpe.c into tests/fuzz/corpus/bpe/ (committed; run again only to change
it). The first byte of each seed picks the harness's mode: 0 a tokenizer.json, 1 text for the fixed tokenizers,
2 text to train on, 3 JSONL. Seeds are small (a few KB) so every execution is quick."""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fuzz", "corpus", "bpe")


def byte_map():
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cps, n = {}, 0
    for b in range(256):
        if b in keep:
            cps[b] = b
        else:
            cps[b] = 256 + n
            n += 1
    return {b: chr(c) for b, c in cps.items()}


def tokenizer(pre, merges_as_pairs=False, added=None, ignore_merges=False):
    m = byte_map()
    vocab = {m[b]: b for b in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "Ġ"), ("Ġ", "a"), ("e", "r")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    toks = [{"id": vocab["<|endoftext|>"], "content": "<|endoftext|>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}] + (added or [])
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": toks, "normalizer": None,
        "pre_tokenizer": pre, "post_processor": None, "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "ignore_merges": ignore_merges, "vocab": vocab,
                  "merges": [[a, b] for a, b in merges] if merges_as_pairs else [f"{a} {b}" for a, b in merges]},
    }, ensure_ascii=False)


BL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
          "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
SPLIT = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
TEXT = ("Hello, world! It's the end; they'll see. 3.14159 and 12345\n\tTabs  and   spaces\u00a0\u3000here\r\n"
        "\u00fcn\u00efc\u00f6d\u00e9 \u65e5\u672c\u8a9e \ud83d\ude00\ud83d\udc4d\ud83c\udffd x<|endoftext|>y 'S 'LL\n")


def put(name, mode, data):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(bytes([mode]) + (data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data))


def main():
    good = tokenizer(BL)
    put("tok_gpt2.json", 0, good)
    put("tok_pairs.json", 0, tokenizer(BL, merges_as_pairs=True))
    put("tok_llama3.json", 0, tokenizer(SPLIT, ignore_merges=True))
    put("tok_prefix.json", 0, tokenizer(dict(BL, add_prefix_space=True)))
    put("tok_added.json", 0, tokenizer(BL, added=[
        {"id": 264, "content": "<mask>", "lstrip": True, "rstrip": True, "single_word": False, "normalized": False, "special": True},
        {"id": 262, "content": "er", "lstrip": False, "rstrip": False, "single_word": True, "normalized": True, "special": False}]))
    put("tok_truncated.json", 0, good[: len(good) // 2])
    put("tok_bad_merge.json", 0, good.replace('"i n"', '"i n x"'))
    put("tok_bad_id.json", 0, good.replace('"Ġt": 256', '"Ġt": -3'))
    put("text_mixed.txt", 1, TEXT.encode("utf-16", "surrogatepass").decode("utf-16"))
    put("text_bytes.bin", 1, bytes(range(256)))
    put("text_spaces.txt", 1, " \n  \n\n\t \r\n   x  y\u2028z\u0085")
    put("train_text.txt", 2, TEXT * 3)
    put("train_bytes.bin", 130, bytes(range(256)) * 2)
    put("jsonl_ok.jsonl", 3, '{"text": "one"}\n\n{"text": "two \\u00e9", "id": 2}\n{"text": ""}')
    put("jsonl_bad.jsonl", 3, '{"text": "one"}\n{"text": 5}\n')
    put("jsonl_deep.jsonl", 3, '{"text": "x", "d": ' + "[" * 70 + "]" * 70 + "}\n")
    print("wrote", len(os.listdir(OUT)), "seeds to", os.path.relpath(OUT))


if __name__ == "__main__":
    main()
