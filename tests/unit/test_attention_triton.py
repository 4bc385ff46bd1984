"""The `triton` attention backend (kiln.runner.attention_triton) and the Triton ops
(kernels="triton": norms, rotary) in a real engine on the CPU, their kernels in Triton's
interpreter: greedy tokens equal to the torch path's, with prefill
chunks mixed with decodes (a small token budget, blocks of 4 tokens), and through the CUDA
graph buckets' padded buffers with the metadata a graph would capture (built once per bucket,
the decode split fixed by max_model_len), run eagerly. The interpreter must be switched on
before anything imports triton (torch does), so the engines run in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("kiln.kernels.triton")

SCRIPT = """
import json, sys
from kiln import LLM, SamplingParams
from kiln.runner.cuda_graphs import run_buckets_eagerly

prompts = ["The quick brown fox", "Paris is the capital of France. Large language models",
           "def add(a, b):", "0123"]
params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

def run(backend, buckets=False, kernels="torch"):
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory=1 << 20, num_threads=1,
              kernels=kernels, attention_backend=backend, block_size=4,
              max_num_batched_tokens=16)
    runner = llm.engine.runner
    if buckets:
        run_buckets_eagerly(runner, max_num_seqs=4, max_model_len=64)
    outs = llm.generate(prompts[:3] if buckets else prompts, params, use_tqdm=False)
    served = runner.graphs.served if runner.graphs else 0
    return [o.outputs[0].token_ids for o in outs], served

print(json.dumps({"torch": run("torch"), "triton": run("triton"),
                  "buckets": run("triton", buckets=True),
                  "triton_ops": run("triton", kernels="triton")}))
"""


def test_triton_backend_gives_the_torch_backends_tokens(llama_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, llama_path], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["triton"][0] == runs["torch"][0]
    assert runs["triton_ops"][0] == runs["torch"][0]  # and the Triton norms and rotary
    tokens, served = runs["buckets"]
    assert tokens == runs["torch"][0][:3] and served > 0  # 3 sequences in the bucket of 4
