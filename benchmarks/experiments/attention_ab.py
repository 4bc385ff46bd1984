"""kiln's attention kernels in this tree against the same sources at another commit, in one
process: each tree's paged_attention.cpp (decodes, drafts) and prefill_attention.cpp (long
prefill chunks) are built as one extension (namespace renamed, kiln's own flags; both trees called the same way,
no dispatcher in either), both run on the same caches, their outputs must be equal bit for
bit, and each is timed with its caches cold (a 256 MiB read between runs, so K and V come from
memory as in a serving step) and warm (one layer's cache read again and again), alternated
(each first in every other round), 9 rounds, medians. Layer shapes of the default model (9
query heads, 3 kv heads, head dim 64), 30 layers, 16-slot blocks in random order.

usage: python benchmarks/experiments/attention_ab.py REV [SHAPE ...]
  SHAPE: SEQS:CONTEXT, a decode step of SEQS sequences over CONTEXT keys each (paged), or
  pTOKENS, one fresh prompt of TOKENS tokens (prefill); e.g. HEAD~1 64:192 1:328 p1024
  (run from the repository root)
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from kiln.kernels.cpu import FLAGS
from kiln.models.arena import huge_page_buffer

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "src/kiln/kernels/cpu"
SOURCES = ("paged_attention.cpp", "prefill_attention.cpp")
GLUE = '''
#include <torch/extension.h>
#include <optional>
namespace kiln_ab {
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start, const at::Tensor& query_lens,
                     const at::Tensor& context_lens, int64_t block_size, double scale,
                     const std::optional<at::Tensor>& tree_mask);
void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_table,
                       const at::Tensor& query_start, const at::Tensor& query_lens,
                       const at::Tensor& context_lens, int64_t block_size, double scale);
}
void run(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor table,
         at::Tensor start, at::Tensor lens, at::Tensor ctx, int64_t block, double scale,
         bool prefill) {
  if (prefill)
    kiln_ab::prefill_attention(out, q, k, v, table, start, lens, ctx, block, scale);
  else
    kiln_ab::paged_attention(out, q, k, v, table, start, lens, ctx, block, scale, std::nullopt);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
'''


def build(rev: str | None, name: str):
    """The attention sources at `rev` (None: this tree's files) as extension `name`."""
    folder = Path(tempfile.mkdtemp())
    for file in SOURCES:
        if rev is None:
            source = (KERNELS / file).read_text()
        else:
            source = subprocess.run(["git", "show", f"{rev}:src/kiln/kernels/cpu/{file}"],
                                    cwd=ROOT, check=True, capture_output=True, text=True).stdout
        source = source.replace('#include "ops.h"', '#include "common.h"\n#include <optional>')
        source = source.replace("namespace kiln {", "namespace kiln_ab {\nusing namespace kiln;",
                                1)
        (folder / file).write_text(source)
    (folder / "glue.cpp").write_text(GLUE)
    paths = [str(folder / f) for f in (*SOURCES, "glue.cpp")]
    return load(name, paths, extra_include_paths=[str(KERNELS)],
                extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False)


def layer_call(mod, out, q, kc, vc, table, start, lens, context, bs, scale, prefill):
    """Layer `layer`'s attention by `mod` into `out`."""
    def call(layer: int) -> None:
        mod.run(out, q, kc[layer], vc[layer], table, start, lens, context, bs, scale, prefill)
    return call


def main() -> None:
    rev, shapes = sys.argv[1], sys.argv[2:] or ["64:192", "1:328"]
    mods = {"this tree": build(None, "attention_ab_head"),
            rev: build(rev, "attention_ab_base")}
    torch.set_num_threads(2)
    torch.manual_seed(0)
    layers, hq, hkv, d, bs = 30, 9, 3, 64, 16
    flush = huge_page_buffer(256 << 20).view(torch.float32).fill_(1)
    for shape in shapes:
        prefill = shape.startswith("p")
        # a decode step: seqs sequences of one token over ctx keys; a prefill: one sequence
        # of ctx fresh tokens
        seqs, ctx = (1, int(shape[1:])) if prefill else map(int, shape.split(":"))
        tokens = ctx if prefill else seqs
        per_seq = -(-(ctx + 1) // bs)
        blocks = seqs * per_seq * 2
        kc = [torch.randn(blocks * bs, hkv, d, dtype=torch.bfloat16) for _ in range(layers)]
        vc = [torch.randn_like(k) for k in kc]
        table = torch.randperm(blocks)[:seqs * per_seq].view(seqs, per_seq)
        q = torch.randn(tokens, hq, d, dtype=torch.bfloat16)
        outs = {"this tree": torch.empty(tokens, hq * d, dtype=torch.bfloat16)}
        outs[rev] = torch.empty_like(outs["this tree"])
        if prefill:
            start, lens, context = torch.tensor([0]), torch.tensor([ctx]), torch.tensor([0])
        else:
            start, lens = torch.arange(seqs), torch.ones(seqs, dtype=torch.long)
            context = torch.full((seqs,), ctx)
        args = (q, kc, vc, table, start, lens, context, bs, d ** -0.5, prefill)
        calls = {name: layer_call(mod, outs[name], *args) for name, mod in mods.items()}
        for call in calls.values():
            call(0)
        assert torch.equal(outs["this tree"], outs[rev]), f"{shape}: outputs differ"
        times = {name: {"cold": [], "warm": []} for name in calls}
        for r in range(9):  # alternated, each first in every other round
            for name, call in list(calls.items())[::1 if r % 2 else -1]:
                flush.sum()
                t = time.perf_counter()
                for layer in range(layers):
                    call(layer)
                times[name]["cold"].append(time.perf_counter() - t)
                call(0)
                t = time.perf_counter()
                for _ in range(layers):
                    call(0)
                times[name]["warm"].append(time.perf_counter() - t)
        for name, t in times.items():
            what = f"prefill of {ctx} tokens" if prefill else f"{seqs} x {ctx} keys"
            print(f"{what}, {layers} layers, {name:>10}: cold "
                  f"{statistics.median(t['cold']) * 1e3:6.2f} ms, warm "
                  f"{statistics.median(t['warm']) * 1e3:6.2f} ms  (outputs equal)", flush=True)


if __name__ == "__main__":
    main()
