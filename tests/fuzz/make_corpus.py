#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer harnesses into tests/fuzz/corpus/<name>/ (committed; run again
only to change them). Each corpus holds a few small valid files and a few broken ones, named for what they are."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(name, fname, data):
    d = os.path.join(HERE, "corpus", name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, fname), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None, header_raw=None):
    """tensors: list of (name, dtype, shape, bytes); written as tide writes them (padded header)."""
    header, data, off = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    h = header_raw if header_raw is not None else json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


f32 = lambda *v: struct.pack("<%df" % len(v), *v)
model = safetensors([
    ("model.embed_tokens.weight", "F32", [2, 3], f32(1, 2, 3, 4, 5, 6)),
    ("model.norm.weight", "BF16", [2], b"\x80\x3f\x80\x3f"),
    ("model.idx", "I64", [2], struct.pack("<2q", -1, 1 << 40)),
    ("model.empty", "U8", [0], b""),
    ("model.scale", "F64", [], struct.pack("<d", 0.5)),
], {"format": "pt", "tide.step": "7", "tide.version": "0.1.0"})
optim = safetensors([
    ("model.embed_tokens.weight.adam_m", "F32", [2, 3], f32(0, 0, 0, 0, 0, 0)),
    ("model.embed_tokens.weight.adam_v", "F32", [2, 3], f32(1e-8, 0, 0, 0, 0, 1)),
], {"format": "pt", "tide.step": "7"})

# safetensors
put("safetensors", "valid_model.safetensors", model)
put("safetensors", "valid_empty.safetensors", safetensors([]))
put("safetensors", "valid_i32_u8.safetensors", safetensors([("a", "I32", [1, 2], struct.pack("<2i", 7, -7)),
                                                             ("b", "U8", [3], b"xyz")]))
put("safetensors", "dtype_f16.safetensors", safetensors([("h", "F16", [2], b"\x00\x3c\x00\x3c")]))
put("safetensors", "ndim_9.safetensors", safetensors([("d", "U8", [1] * 9, b"\x01")]))
put("safetensors", "truncated.safetensors", model[: len(model) - 5])
put("safetensors", "header_too_long.safetensors", struct.pack("<Q", 1 << 40) + model[8:])
put("safetensors", "overlap.safetensors", safetensors([], header_raw=b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                                                      b'"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}') + b"abc")
put("safetensors", "shape_mismatch.safetensors", safetensors([], header_raw=b'{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}') + b"\0" * 8)

# token shards (llm.c): a 256 x int32 header, then the tokens
def shard(magic, version, tokens, width, count=None):
    hdr = struct.pack("<3i", magic, version, len(tokens) if count is None else count) + b"\0" * (1024 - 12)
    return hdr + struct.pack("<%d%s" % (len(tokens), "H" if width == 2 else "I"), *tokens)

put("shards", "gpt2_u16.bin", shard(20240520, 1, [0, 1, 50256, 65535, 300, 7], 2))
put("shards", "llama3_u32.bin", shard(20240801, 7, [0, 128000, 2**31 - 1, 42], 4))
put("shards", "empty_shard.bin", shard(20240520, 1, [], 2))
put("shards", "eval_magic.bin", shard(20240522, 1, [1, 2], 2))
put("shards", "bad_version.bin", shard(20240801, 1, [1, 2], 4))
put("shards", "count_mismatch.bin", shard(20240520, 1, [1, 2, 3], 2, count=4))
put("shards", "token_too_big.bin", shard(20240801, 7, [2**31 + 5], 4))
put("shards", "raw_odd.bin", b"\x01\x02\x03")

# text
put("text", "english.txt", "The quick brown fox jumps over the lazy dog.\nA second line.\n")
put("text", "utf8.txt", "naïve café — 東京 😀\n")
put("text", "binary.txt", bytes(range(256)))
put("text", "one_byte.txt", "x")
put("text", "empty.txt", b"")

# JSON (the metadata object save accepts, and safetensors headers with an empty data buffer)
put("json", "metadata.json", '{"format":"pt","tide.step":"7","tide.version":"0.1.0"}')
put("json", "escapes.json", '{"a":"quote \\" backslash \\\\ tab \\t nl \\n","u":"\\u00e9\\ud83d\\ude00","z":"\\u0000x"}')
put("json", "empty_object.json", "{}")
put("json", "zero_tensors.json", '{"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},'
                                 '"b":{"dtype":"I64","shape":[3,0],"data_offsets":[0,0]}}')
put("json", "not_strings.json", '{"format":1,"nested":{"a":"b"},"list":[1,2]}')
put("json", "duplicate_key.json", '{"a":"1","a":"2"}')
put("json", "deep.json", "[" * 200 + "]" * 200)
put("json", "bad.json", '{"a":"unterminated')

# checkpoint directories: state.json, model.safetensors, optim.safetensors, latest
SEP = b"\n--tide-ckpt--\n"
state = json.dumps({"step": 7, "kind": "train", "optim": {"kind": "adamw", "t": 7},
                    "rng": {"seed": "1", "offset": "1024"}, "cursor": 3,
                    "names": ["model.embed_tokens.weight.adam_m", "model.embed_tokens.weight", "missing"]},
                   separators=(",", ":")).encode() + b"\n"
latest = b"step_00000001\n"
put("checkpoint", "valid.ckpt", SEP.join([state, model, optim, latest]))
put("checkpoint", "no_optim.ckpt", SEP.join([state, model]))
put("checkpoint", "truncated_model.ckpt", SEP.join([state, model[:40], optim, latest]))
put("checkpoint", "bad_state.ckpt", SEP.join([b'{"step":2.5,"optim":', model, optim, b"step_x\n"]))
put("checkpoint", "empty_files.ckpt", SEP.join([b"", b"", b"", b""]))

# gunzip (engine/io/gunzip.c): single-member .gz files with and without the optional header fields, and broken ones
import gzip as _gzip
import zlib as _zlib


def gz_member(payload, flags=0, extra=b"", name=b"", comment=b""):
    head = b"\x1f\x8b\x08" + bytes([flags]) + b"\0\0\0\0\0\xff"
    if flags & 4:
        head += struct.pack("<H", len(extra)) + extra
    if flags & 8:
        head += name + b"\0"
    if flags & 16:
        head += comment + b"\0"
    if flags & 2:
        head += struct.pack("<H", _zlib.crc32(head) & 0xFFFF)
    c = _zlib.compressobj(9, _zlib.DEFLATED, -15)
    body = c.compress(payload) + c.flush()
    return head + body + struct.pack("<II", _zlib.crc32(payload) & 0xFFFFFFFF, len(payload) & 0xFFFFFFFF)


csv = b"".join(b"0,1,2,3,16,%d\n" % k for k in range(40))
put("gunzip", "plain.gz", _gzip.compress(csv, mtime=0))
put("gunzip", "empty.gz", _gzip.compress(b"", mtime=0))
put("gunzip", "all_fields.gz", gz_member(b"hello, gzip\n" * 20, flags=2 | 4 | 8 | 16, extra=b"ab\x02\x00xy",
                                         name=b"hello.txt", comment=b"a comment"))
# one final stored (uncompressed) block: BFINAL = 1, BTYPE = 00, LEN, NLEN, the bytes
put("gunzip", "stored.gz", b"\x1f\x8b\x08\0\0\0\0\0\0\xff" + b"\x01" + struct.pack("<HH", 6, 0xFFFF ^ 6) + b"stored"
    + struct.pack("<II", _zlib.crc32(b"stored"), 6))
put("gunzip", "truncated.gz", _gzip.compress(csv, mtime=0)[:-20])
put("gunzip", "bad_crc.gz", _gzip.compress(csv, mtime=0)[:-8] + b"\0\0\0\0" + struct.pack("<I", len(csv)))
