"""bf16 against fp32, kiln and HF transformers side by side on the default model (issue 52).

Per engine: how many of kiln.testing.fidelity's 42 short questions get the same greedy answer
(16 tokens) in bf16 as in fp32, the mean KL(fp32 || bf16) of next-token distributions over
its held-out text, and the bf16 answer to the README's question; with the CPU's model and ISA
(kiln.kernels.isa), since bf16 arithmetic differs between CPUs. tests/engine/test_fidelity.py
asserts the same figures (kiln at least as good as HF).

    python benchmarks/fidelity.py [--kernels auto|cpp|torch] [--out benchmarks/results/fidelity.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kiln.kernels.isa import cpu_isa
from kiln.models.default import default_model_path
from kiln.testing.fidelity import hf_fidelity, kiln_fidelity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="auto", choices=("auto", "cpp", "torch"))
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    path = default_model_path()
    isa = cpu_isa()
    started = time.perf_counter()
    kiln, _ = kiln_fidelity(path, kernels=args.kernels)
    hf, _ = hf_fidelity(path)
    record = {"cpu": {"model": isa.model_name, "vendor": isa.vendor, "family": isa.family,
                      "model_id": isa.model, "isa": list(isa.extensions), "level": isa.level},
              "threads": torch.get_num_threads(), "kernels": args.kernels,
              "engines": [dataclasses.asdict(kiln), dataclasses.asdict(hf)],
              "seconds": round(time.perf_counter() - started, 1)}
    print(f"cpu: {isa.describe()} (level {isa.level}), {torch.get_num_threads()} threads")
    print(f"{'engine':8} {'bf16 == fp32 answers':>22} {'mean KL (nats)':>16}  README answer (bf16)")
    for f in (kiln, hf):
        print(f"{f.engine:8} {f'{f.agreement}/{f.questions}':>22} {f.mean_kl:>16.6f}  "
              f"{f.readme_answer!r}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
