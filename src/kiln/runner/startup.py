"""What the runner decides once, before it loads the model: its thread count, whether the
model splits over the configured ranks (checked before any other rank's process starts),
and, once loaded, whether the decoder stack runs as one fused call (kiln.runner.fused_stack).
"""

from __future__ import annotations

import logging
import os

import torch

from kiln.config import ModelConfig, ParallelConfig, default_num_threads
from kiln.distributed.launch import default_threads_per_rank
from kiln.models.layers.attention import AttentionBackend
from kiln.models.layers.expert_parallel import ExpertParallelOptions, check_expert_parallel
from kiln.models.layers.parallel import check_row_formats, check_tensor_parallel
from kiln.models.loader import read_hf_config
from kiln.models.registry import resolve_architecture
from kiln.platform import Platform
from kiln.runner import fused_stack
from kiln.runner.data_parallel import check_data_parallel
from kiln.runner.pipeline import check_stages

log = logging.getLogger(__name__)


def num_threads(parallel: ParallelConfig) -> int:
    """Torch's intra-op threads for this process: the configured count, else the machine's
    default for one process, or its share of the node for one of several ranks."""
    return parallel.num_threads or (
        default_num_threads() if parallel.world_size == 1 else default_threads_per_rank(
            parallel.ranks_per_node))


def check_splits(model_config: ModelConfig, model_path: str, parallel: ParallelConfig) -> None:
    """Raise unless the model splits as `parallel` asks: data-parallel attention, pipeline
    stages, tensor-parallel heads, experts and quantized rows."""
    model_class, arch = resolve_architecture(hf_config := read_hf_config(model_path))
    if parallel.data_parallel_size > 1:
        check_data_parallel(parallel, arch, check_expert_parallel)
    if parallel.pipeline_parallel_size > 1:
        check_stages(parallel, model_class, arch.num_layers)
    tp_size = parallel.tensor_parallel_size
    if tp_size > 1:
        check_tensor_parallel(tp_size, arch.num_heads, arch.num_kv_heads,
                              arch.intermediate_size)
        if getattr(arch, "moe", None) is not None:  # a MoE family's experts over the ranks
            check_expert_parallel(arch.moe, tp_size,
                                  ExpertParallelOptions.from_parallel(parallel))
        row_inputs = getattr(arch, "row_parallel_inputs", None)  # (MLA: V per head)
        check_row_formats(tp_size, hf_config, model_config.quantization,
                          row_inputs() if row_inputs is not None else
                          {"o_proj": arch.num_heads * arch.head_dim,
                           "down_proj": arch.intermediate_size})


def fused_stack_weights(platform: Platform, model: torch.nn.Module,
                        backend: AttentionBackend) -> fused_stack.StackWeights | None:
    """The decoder stack's weights for one fused call, where the platform and every layer
    allow it; None: the layers run one call each."""
    if not platform.fused_stack or os.environ.get("KILN_DISABLE_FUSED_STACK"):
        return None  # (the variable: benchmarks and tests, for the per-layer path)
    stack = fused_stack.stack_weights(model, backend)
    if stack is None:
        log.info("decoder layers run one call each (a layer is off the fused path, or "
                 "tensor-parallel ranks sum over gloo: see "
                 "kiln.runner.fused_stack.stack_weights)")
    return stack
