#!/usr/bin/env python3
"""Writes the tokenizer fixtures of tests/lua/test_bpe.lua into tests/fixtures/tokenizers/ (committed; run again
only to change them; needs build/pyenv from scripts/test_deps.sh):

  multilingual.txt   text written for these tests: many scripts, digits of several systems, combining marks, emoji
                     (modifiers, ZWJ sequences, flags, keycaps), every kind of Unicode white space, CRLF, runs of
                     spaces, contractions in both cases, code, and tide's special names inside words
  hf_bpe.json        a byte-level BPE trained by the tokenizers library itself (BpeTrainer, vocab 1024, the full
                     byte alphabet, specials <|endoftext|> and <|pad|>) on the fortunes files and multilingual.txt
  expected.json      for each (tokenizer, text): the text's SHA-256 and the ids tokenizers gives, as an llm.c shard
  *.bin              those ids (formats.md §3, uint16)

Run: build/pyenv/bin/python tests/scripts/make_tokenizer_fixtures.py
"""
import hashlib
import json
import os
import struct
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizers")
FORTUNES = "/usr/share/games/fortunes"
# fortunes files whose ids are stored (the test checks the installed file's SHA-256 first)
FORTUNE_FILES = ["science"]

MULTILINGUAL = "\n".join([
    "Plain English first: it's simple, isn't it? We're sure they've said you'll see what I'd mean.",
    "SHOUTING: IT'S LOUD, WE'RE HERE, THEY'VE GONE, YOU'LL SEE, I'M DONE, HE'D KNOW, SHE'LL GO.",
    "Mixed case contractions: It'S, we'Re, they'Ve, i'M, you'Ll, he'D; odd ones: 'x 'ſ 'ſt '' ''s.",
    "Numbers: 0 7 42 123 4567 89012 3.14159 1,000,000 2024-05-20 0x1F 1e-9 -17 +3.5% 12:30:45.",
    "Other digits: \u0966\u0967\u0968\u0969 \u0663\u0664\u0665 \u0e51\u0e52\u0e53 \uff11\uff12\uff13 "
    "\u2160\u2161\u216b \u00bd \u00be \u00b2\u00b3 \u2460\u2461 \U0001d7d8\U0001d7d9.",
    "Greek: \u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1, \u03c4\u03b9 \u03ba\u03ac\u03bd\u03b5\u03b9\u03c2; "
    "Cyrillic: \u041f\u0440\u0438\u0432\u0435\u0442, \u043a\u0430\u043a \u0434\u0435\u043b\u0430?",
    "Hebrew: \u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd. Arabic: \u0645\u0631\u062d\u0628\u0627 "
    "\u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0643\u064a\u0641 \u062d\u0627\u0644\u0643\u061f",
    "Devanagari: \u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e\u0964 "
    "Tamil: \u0bb5\u0ba3\u0b95\u0bcd\u0b95\u0bae\u0bcd. Thai: \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a",
    "Chinese: \u4f60\u597d\uff0c\u4e16\u754c\uff01\u6211\u4eec\u5728\u6d4b\u8bd5\u5206\u8bcd\u5668\u3002 "
    "Japanese: \u3053\u3093\u306b\u3061\u306f\u3001\u30ab\u30bf\u30ab\u30ca\u3068\u6f22\u5b57\u3002",
    "Korean: \uc548\ub155\ud558\uc138\uc694 \uc138\uc0c1. Georgian: \u10d2\u10d0\u10db\u10d0\u10e0\u10ef\u10dd\u10d1\u10d0. "
    "Armenian: \u0562\u0561\u0580\u0587. Ethiopic: \u1230\u120b\u121d\u1362",
    "Combining: e\u0301 n\u0303 a\u0308\u0304 Z\u0335\u0321\u032a\u0351a\u0336\u0327l\u0337g\u0334o\u0338 "
    "\u0915\u093f \u0e01\u0e34\u0e4a precomposed: \u00e9 \u00f1 \u00e4.",
    "Emoji: \U0001f600 \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 "
    "\U0001f1eb\U0001f1f7 \u2764\ufe0f 1\ufe0f\u20e3 \U0001f3f3\ufe0f\u200d\U0001f308 \U0001f9d1\U0001f3ff\u200d\U0001f4bb!!",
    "Letters beyond the BMP: \U0001d400\U0001d401\U0001d402 \U00010330\U00010331 \U0002000b\U00020021; "
    "circled: \u24d0\u24d1\u24b6 \U0001f130\U0001f131.",
    "Spaces:\ttab\t\ttwo tabs,  two spaces,   three,\u00a0nbsp,\u3000ideographic,\u2003em,\u2009thin, "
    "\u205fmath\u0085nel\u2028line sep\u2029para sep.",
    "Windows line\r\nends\r\n\r\nand a lone\rCR;   trailing spaces   ",
    "      ",
    "\t \t ",
    "",
    "Punctuation runs: !!! ??? ... \u2014 \u2013 \u00ab\u00bb \u201c\u201d \u2018\u2019 \u00bf\u00a1 (#@$%^&*) [{<>}] ~~ `` ;; ::",
    "Code:\ndef f(x):\n    return x ** 2  # square\n\nif (a && b || !c) { y = {\"k\": [1, 2.5, null]}; }",
    "URL https://example.org/path?q=1&r=two#frag and mail a.b@example.com, path C:\\Users\\x\\file.txt",
    "Specials in text: before<|endoftext|>after <|pad|> spaced <|endoftext|><|endoftext|> end<|pad|>",
    "Near misses: <|endoftext| <|pad |> <| endoftext |> <|endoftex|> <<|pad|>>",
    "Private use \ue000\uf8ff and a noncharacter \ufdd0, BOM-like \ufeff inside, soft\u00adhyphen, "
    "zero\u200bwidth, word\u2060joiner.",
    "The end.",
    "",
])


def write(name, data):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


def shard(ids):
    width = 2 if max(ids, default=0) < 65536 else 4
    header = [20240520 if width == 2 else 20240801, 1 if width == 2 else 7, len(ids)] + [0] * 253
    return struct.pack("<256i", *header) + struct.pack(f"<{len(ids)}{'H' if width == 2 else 'I'}", *ids)


def fortune_paths():
    names = sorted(n for n in os.listdir(FORTUNES) if not n.endswith((".dat", ".u8"))
                   and os.path.isfile(os.path.join(FORTUNES, n)))
    return [os.path.join(FORTUNES, n) for n in names]


def main():
    os.makedirs(OUT, exist_ok=True)
    write("multilingual.txt", MULTILINGUAL)
    texts = [os.path.join(OUT, "multilingual.txt")] + fortune_paths()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, min_frequency=2, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(texts, trainer)
    tok.save(os.path.join(OUT, "hf_bpe.json"))

    cases = []
    for label, path in [("multilingual", texts[0])] + [(f"fortunes-{n}", os.path.join(FORTUNES, n)) for n in FORTUNE_FILES]:
        raw = open(path, "rb").read()
        ids = tok.encode(raw.decode("utf-8"), add_special_tokens=False).ids
        fname = f"hf_bpe.{label}.bin"
        write(fname, shard(ids))
        # a fortunes file is named "fortunes:<name>" (the test finds the directory as the recipes do)
        text = "fortunes:" + os.path.basename(path) if path.startswith(FORTUNES) else "multilingual.txt"
        cases.append({"tokenizer": "hf_bpe.json", "text": text,
                      "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), "ids": fname, "count": len(ids)})
    import tokenizers
    write("expected.json", json.dumps({"tokenizers": tokenizers.__version__, "cases": cases}, indent=2) + "\n")
    total = sum(os.path.getsize(os.path.join(OUT, n)) for n in os.listdir(OUT))
    print(f"wrote {len(os.listdir(OUT))} files, {total} bytes, to {os.path.relpath(OUT, ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
