"""Quantized experts' KL per format (issue 49): `kiln quantize` in every uniform scheme on the
upcycled SmolLM2 mixture of experts (benchmarks/moe_upcycle.py) and on the dense SmolLM2 it
came from, with the same settings (the defaults of docs/quantization.md: GPTQ with searched
scales and act order, 8 held-out windows of 512 tokens, measured in fp32), one row per model
and scheme: bits/weight, mean and p99 KL, top-1 agreement, perplexity.

  python benchmarks/moe_upcycle.py --out /tmp/moeq/smollm2-moe
  python benchmarks/moe_quantization.py --moe /tmp/moeq/smollm2-moe --work /tmp/moeq/runs \\
      --out benchmarks/results/moe_quantization.json

Each run is `kiln quantize --model M --scheme S --out WORK/{moe,dense}/S --threads T` (its
command is recorded beside its row); a run whose report already exists is read, not redone.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from kiln.models.default import default_model_path
from kiln.quant.pipeline import SCHEMES


def command(model: str, scheme: str, out: Path, threads: int, method: str) -> list[str]:
    return ["kiln", "quantize", "--model", model, "--scheme", scheme, "--out", str(out),
            "--threads", str(threads), "--method", method]


def portable(text: str) -> str:
    """`text` with the home directory as ~ and /tmp paths as WORK (no machine paths in the
    committed results)."""
    return re.sub(r"/tmp/[^ ]*?/", "WORK/", text.replace(str(Path.home()), "~"), count=0)


def measure(model: str, scheme: str, out: Path, threads: int, method: str) -> dict:
    cmd = command(model, scheme, out, threads, method)
    report = out / "quantization_report.json"
    if not report.is_file():
        subprocess.run([sys.executable, "-m", "kiln.cli", *cmd[1:]], check=True)
    row = json.loads(report.read_text())["held_out"][0]
    return {"scheme": scheme, "format": SCHEMES[scheme], "command": portable(" ".join(cmd)),
            "bits_per_weight": round(row["bits_per_weight"], 4),
            "linear_mb": round(row["linear_bytes"] / 1e6, 1), **row["fidelity"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--moe", required=True, help="the upcycled checkpoint (moe_upcycle.py)")
    p.add_argument("--work", type=Path, required=True, help="where the checkpoints go")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/moe_quantization.json"))
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--method", default="gptq", choices=["gptq", "rtn"])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    models = {"moe": args.moe, "dense": str(default_model_path())}
    rows = [{"model": name, **measure(path, s, args.work / name / s, args.threads, args.method)}
            for s in args.schemes.split(",") for name, path in models.items()]
    print(f"{'model':6} {'scheme':6} {'bits/w':>6} {'mean KL':>8} {'p99 KL':>7} {'top-1':>6}")
    for r in rows:
        print(f"{r['model']:6} {r['scheme']:6} {r['bits_per_weight']:6.2f} {r['mean_kl']:8.4f} "
              f"{r['p99_kl']:7.3f} {r['top1_agreement']:6.1%}")
    upcycle = json.loads((Path(args.moe) / "config.json").read_text())
    args.out.write_text(json.dumps({
        "models": {"moe": f"SmolLM2-135M-Instruct upcycled (benchmarks/moe_upcycle.py): "
                          f"Mixtral, {upcycle['num_local_experts']} experts, top "
                          f"{upcycle['num_experts_per_tok']}",
                   "dense": "SmolLM2-135M-Instruct (bundled default model)"},
        "method": args.method, "text": "built-in held-out mix, 8 windows x 512 tokens, fp32",
        "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
