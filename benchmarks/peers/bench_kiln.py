"""kiln's side of the CPU speed table, printing JSON lines like the peers' scripts.

Tests (TESTS=comma list; default all):
  batch1     128-token prompt, 128 greedy tokens (EOS ignored): prefill ms and decode tok/s;
             with CEILING=1 also the memory read bandwidth (benchmarks/ceiling.py's reads) in
             this process right before and right after the decode runs, and the batch-1
             ceiling it implies: decode as a fraction of what the host gave at that minute
  ttft1024   time to first token of a fresh 1,024-token prompt
  offline64  64 prompts x 128 in / 128 out, all submitted at once: output tok/s
usage: [TESTS=...] [QUANT=int8] python bench_kiln.py CKPT PROMPTS.json [reps] [threads]
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

from kiln import LLM, SamplingParams

ckpt, pfile = sys.argv[1], sys.argv[2]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
threads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
tests = os.environ.get("TESTS", "batch1,ttft1024,offline64").split(",")
quant = os.environ.get("QUANT") or None
ceiling = os.environ.get("CEILING") == "1"
prompts = json.load(open(pfile))
llm = LLM(ckpt, dtype="bfloat16", max_model_len=2048, num_threads=threads, quantization=quant,
          kv_cache_memory=1 << 30)
base = dict(peer="kiln", ckpt=os.path.basename(ckpt.rstrip("/")), threads=threads,
            quantization=quant or "bf16", reps=reps)


def run(ps, new):
    llm.engine.kv.pool.reset_prefix_cache()  # every run starts cold, like the peers
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    return dt


if ceiling:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ceiling import bandwidth, decode_bytes


def ceiling_tok_s():
    """Batch-1 decode ceiling now: the best read rate of ceiling.py's methods / bytes a step
    reads (the weights)."""
    gbs = bandwidth(1024, 5, use_cpp=True)["best"]
    return gbs, gbs * 1e9 / decode_bytes(Path(ckpt))


run(prompts[:8], 16)  # warm-up
if "batch1" in tests:
    before = ceiling_tok_s() if ceiling else None
    tot = [run(prompts[:1], 128) for _ in range(reps)]
    pre = [run(prompts[:1], 1) for _ in range(reps)]
    after = ceiling_tok_s() if ceiling else None
    T, P = statistics.median(tot), statistics.median(pre)
    row = dict(base, test="batch1", prefill_ms=round(P * 1000, 1),
               decode_tok_s=round(127 / (T - P), 1), e2e_tok_s=round(128 / T, 1),
               runs_s=[round(x, 3) for x in tot])
    if ceiling:  # the mean of the two reads: the host's rate over the decode runs
        row.update(read_gbs=[before[0], after[0]],
                   ceiling_tok_s=round((before[1] + after[1]) / 2, 1))
    print(json.dumps(row), flush=True)
if "ttft1024" in tests:
    long_prompt = [t for p in prompts[:8] for t in p][:1024]
    ts = [run([long_prompt], 1) for _ in range(reps)]
    print(json.dumps(dict(base, test="ttft1024", ttft_ms=round(statistics.median(ts) * 1000, 1),
                          runs_s=[round(x, 3) for x in ts])), flush=True)
if "offline64" in tests:
    ts = [run(prompts[:64], 128) for _ in range(reps)]
    T = statistics.median(ts)
    print(json.dumps(dict(base, test="offline64", out_tok_s=round(64 * 128 / T, 1),
                          runs_s=[round(x, 3) for x in ts])), flush=True)
