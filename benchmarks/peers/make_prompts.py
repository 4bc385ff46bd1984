"""Adapted from shared/peers/make_prompts.py (our project's helper). Changed: writes the prompts
to an OUT path given on the command line instead of CKPT/bench_prompts.json, so kiln's model cache
is never written to.

Write OUT: 64 prompts of exactly 128 token ids each, cut from Python stdlib source text with the
checkpoint's own tokenizer.
usage: python make_prompts.py CKPT OUT.json"""
import glob
import json
import os
import sys
import sysconfig

from transformers import AutoTokenizer

ckpt, out = sys.argv[1], sys.argv[2]
n_prompts, plen = 64, 128
tok = AutoTokenizer.from_pretrained(ckpt)
d = sysconfig.get_paths()["stdlib"]
files = sorted(glob.glob(os.path.join(d, "*.py")))
prompts = []
for f in files:
    text = open(f, encoding="utf-8", errors="ignore").read()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) >= plen + 200:
        prompts.append(ids[100:100 + plen])
    if len(prompts) == n_prompts:
        break
assert len(prompts) == n_prompts
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
json.dump(prompts, open(out, "w"))
print(out, len(prompts), "x", plen)
