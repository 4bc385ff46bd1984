"""kiln's kernels: the fast versions of ops whose plain torch reference lives with the code that
calls them, each tested against that reference (tests/kernels/, one file per op family).

- `cpu/`: kiln's C++ CPU kernels, one source per op family (norms and rotary, KV cache writes,
  paged and prefill attention, int8 and bf16 matmuls, sampling, the fused decoder stack), built
  into one torch extension on first use and registered as `torch.ops.kiln.*`.
- `quant_mm`, `bf16_mm`: which matmul kernel serves quantized and dense bf16 weights on this
  CPU (torch's, oneDNN's or kiln's), their token limits, and the probes that say whether each
  runs here.
- `triton/`: the GPU kernels, in Triton, each beside the torch reference it must match and run
  on CPU by Triton's interpreter in tests (docs/triton_kernels.md).

This package is a leaf: it imports torch and nothing else of kiln, so models, runner and the
platform seam can all use it.
"""
