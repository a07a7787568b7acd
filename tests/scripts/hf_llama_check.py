"""The transformers side of tests/lua/test_export.lua: loads a directory written by `tide export` with
LlamaForCausalLM and reports, as one JSON object on stdout, what the Lua test asserts:

  missing / unexpected / mismatched   the loading info of from_pretrained (all empty for a faithful export)
  max_abs_logit_diff                  max |logits - tide's logits| on the test's token ids
  greedy                              greedy continuation of the test's prompt (model.generate, no sampling)
  tokenizer_ids / tokenizer_decode    the directory's tokenizer.json (tokenizers) on the test's text
  auto_tokenizer_ids                  the same through AutoTokenizer (tokenizer_config.json)
  sharded                             the files save_pretrained wrote when asked for small shards

usage: python hf_llama_check.py SPEC.json   (SPEC: {"cases": [{"dir", "inputs", "text", "greedy_new",
                                            "save_sharded" (optional)}]}; inputs: a safetensors file with "ids"
                                            [B, T], "logits" [B, T, V] (tide's) and "prompt" [n])
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer, LlamaForCausalLM


def check(case):
    model, info = LlamaForCausalLM.from_pretrained(case["dir"], output_loading_info=True, torch_dtype=torch.float32)
    model.eval()
    inputs = load_file(case["inputs"])
    with torch.no_grad():
        logits = model(inputs["ids"].long()).logits
        diff = (logits - inputs["logits"].float()).abs().max().item()
        model.generation_config.eos_token_id = None          # tide's greedy run does not stop at <|endoftext|>
        prompt = inputs["prompt"].long().view(1, -1)
        out = model.generate(prompt, max_new_tokens=case["greedy_new"], do_sample=False,
                             pad_token_id=model.config.pad_token_id)
    greedy = out[0, prompt.shape[1]:].tolist()
    tok = Tokenizer.from_file(os.path.join(case["dir"], "tokenizer.json"))
    enc = tok.encode(case["text"], add_special_tokens=False).ids
    auto = AutoTokenizer.from_pretrained(case["dir"])
    result = {
        "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": [str(m) for m in info["mismatched_keys"]],
        "max_abs_logit_diff": diff, "greedy": greedy,
        "tokenizer_ids": enc, "tokenizer_decode": tok.decode(enc, skip_special_tokens=False),
        "auto_tokenizer_ids": auto(case["text"], add_special_tokens=False)["input_ids"],
    }
    if case.get("save_sharded"):
        model.save_pretrained(case["save_sharded"], safe_serialization=True, max_shard_size="50KB")
        auto.save_pretrained(case["save_sharded"])
        result["sharded"] = sorted(os.listdir(case["save_sharded"]))
    return result


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print(json.dumps({"cases": [check(c) for c in spec["cases"]],
                      "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__}}))


if __name__ == "__main__":
    main()
