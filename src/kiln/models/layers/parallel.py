"""Tensor parallelism in the model: which part of each layer a rank holds, and its collectives.

Megatron's split, over T ranks:
  - column-parallel (QKV, gate/up, the LM head): a rank holds some output rows of W and
    computes those outputs; no communication.
  - row-parallel (o_proj, down_proj): a rank holds the matching input columns, computes a
    partial sum, and one all-reduce adds the ranks' partial sums.
  - attention runs on a rank's own heads: Hq / T query heads and their KV heads (Hkv / T,
    or, where T exceeds Hkv, the one KV head its query heads share, replicated), so each
    rank's KV cache holds only its heads.
  - the vocab-parallel embedding holds ceil(V / T) rows of the table (zeros past V); a token
    another rank holds looks up zeros here, and one all-reduce assembles the rows.
  - the LM head's logits [N, ceil(V / T)] are gathered to rank 0 in fp32 and cut to V.

`TensorParallel` is what a model is built with: `SINGLE` (one process) hands every method back
unchanged, so the single-process model is the same module, weights and bits as before.
The sharded methods wrap the weight format's own method (the linear-method seam,
kiln.models.layers.linear): they slice each checkpoint tensor to this rank's part and hand it
on, and a row-parallel one all-reduces the output. Their `stack_tensors` are the format's own,
a row-parallel one's naming its group: the fused decoder stack (kiln.runner.fused_stack) then
runs each rank's shard and sums o_proj's and down_proj's outputs from inside its C++ loop
(kernels/cpu/stack.cpp), which it can do through the shared-memory all-reduce only; over gloo
a row-parallel `stack_tensors` is None and ranks run the layers one call each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed.communicator import Communicator, ShmCommunicator
from kiln.models.layers.linear import Linear, LinearMethod, StackTensors, get_linear_method


@dataclass(frozen=True)
class HeadSplit:
    """One rank's attention heads: query heads [q_start, q_start + q) and KV heads
    [kv_start, kv_start + kv) of the full model."""

    q: int
    kv: int
    q_start: int
    kv_start: int

    def qkv_rows(self, head_dim: int) -> tuple[slice, slice, slice]:
        """Rows of the checkpoint's q, k and v weights this rank keeps."""
        q = slice(self.q_start * head_dim, (self.q_start + self.q) * head_dim)
        kv = slice(self.kv_start * head_dim, (self.kv_start + self.kv) * head_dim)
        return q, kv, kv


class TensorParallel:
    """A model's place among T ranks; `SINGLE` is the one-process model."""

    def __init__(self, comm: Communicator | None, experts: object | None = None):
        self.comm = comm
        # how MoE layers place their experts: an ExpertParallelOptions (typed `object` here,
        # since kiln.models.layers.expert_parallel imports this module); None: each expert
        # split by columns, as the dense MLP
        self.experts = experts
        self.rank = comm.rank if comm is not None else 0
        self.size = comm.world_size if comm is not None else 1

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadSplit:
        q = num_heads // self.size
        if self.size <= num_kv_heads:
            kv = num_kv_heads // self.size
            return HeadSplit(q, kv, self.rank * q, self.rank * kv)
        # more ranks than KV heads: ranks_per_kv ranks share (replicate) each KV head
        ranks_per_kv = self.size // num_kv_heads
        return HeadSplit(q, 1, self.rank * q, self.rank // ranks_per_kv)

    def part(self, n: int) -> slice:
        """This rank's equal share of n (n divisible by size: check_tensor_parallel)."""
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def vocab_rows(self, vocab_size: int) -> slice:
        """This rank's rows of the vocabulary: ceil(V / T) of them, the last share short."""
        per = -(-vocab_size // self.size)
        return slice(self.rank * per, min(vocab_size, (self.rank + 1) * per))

    def vocab_per_rank(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def column(self, method: LinearMethod, rows: Sequence[slice]) -> LinearMethod:
        """`method` keeping `rows[i]` of output shard i (one process: `method` itself)."""
        return method if self.comm is None else ColumnParallel(method, tuple(rows))

    def row(self, method: LinearMethod, cols: slice) -> LinearMethod:
        """`method` keeping input columns `cols`, its output summed over the ranks."""
        return method if self.comm is None else RowParallel(method, cols, self.comm)

    def embedding(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> nn.Module:
        if self.comm is None:
            embed = nn.Embedding(vocab_size, hidden_size, dtype=dtype, device="cpu")
            embed.weight.requires_grad_(False)
            return embed
        return VocabParallelEmbedding(vocab_size, hidden_size, dtype, self)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Every rank's fp32 logits [N, V / T] -> rank 0's [N, V]; None on the others."""
        if self.comm is None:
            return local
        parts = self.comm.gather_to_first(local)
        return None if parts is None else torch.cat(parts, dim=-1)[..., :vocab_size]


SINGLE = TensorParallel(None)


def check_tensor_parallel(size: int, num_heads: int, num_kv_heads: int,
                          intermediate_size: int) -> None:
    """ValueError naming the numbers where the model cannot be split over `size` ranks."""
    if size == 1:
        return
    problems = []
    if num_heads % size:
        problems.append(f"{num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        problems.append(f"{num_kv_heads} KV heads (neither divides the other)")
    if intermediate_size % size:
        problems.append(f"intermediate size {intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         f"{', '.join(problems)}")


def take_rows(tensor: torch.Tensor, rows: slice, size: int) -> torch.Tensor:
    """tensor[rows] padded with zero rows to `size` (the vocabulary's short last share)."""
    part = tensor[rows]
    if part.shape[0] == size:
        return part
    pad = part.new_zeros((size - part.shape[0], *part.shape[1:]))
    return torch.cat([part, pad])


class ColumnParallel:
    """A LinearMethod keeping some output rows of each shard: `rows[i]` of the checkpoint's
    tensors for output shard i (every tensor a format stores is indexed by output row first:
    weights, biases, per-row and per-group scales). The layer is built with this rank's shard
    sizes. A method that stores a weight in a format of its own splits it itself (`rank_rows`,
    kiln.quant's methods: a per-tensor scale stays whole, a dense weight is quantized whole
    first)."""

    def __init__(self, inner: LinearMethod, rows: tuple[slice, ...]):
        self.inner, self.rows = inner, rows

    def create_weights(self, layer, in_features, out_shards, bias, dtype):
        self.inner.create_weights(layer, in_features, out_shards, bias, dtype)

    def load_shard(self, layer: Linear, shard, name, tensor):
        rows, size = self.rows[shard], layer.out_shards[shard]
        split = getattr(self.inner, "rank_rows", None)
        parts = ({name: take_rows(tensor, rows, size)} if split is None
                 else split(name, tensor, rows, size))
        for key, value in parts.items():
            self.inner.load_shard(layer, shard, key, value)

    def finalize(self, layer):
        self.inner.finalize(layer)

    def apply(self, layer, x):
        return self.inner.apply(layer, x)

    def apply_fp32(self, layer, x):
        return self.inner.apply_fp32(layer, x)

    def stack_tensors(self, layer) -> StackTensors | None:
        """The format's own tensors: they hold this rank's rows already."""
        return self.inner.stack_tensors(layer)


def check_row_shardable(method: LinearMethod, in_features: int | None = None,
                        world: int = 2) -> None:
    """ValueError unless `method`'s weights split into `world` ranges of input columns with
    one process's numbers. Dense weights always do; a method storing its own format says
    (`check_rank_columns`, kiln.quant's methods: whole groups per rank, and no activation
    scale over the whole row). `in_features` None: the checks that hold for any size (rank 0
    runs them before any process starts)."""
    check = getattr(method, "check_rank_columns", None)
    if check is not None:
        check(world, in_features)


def check_row_formats(size: int, hf_config: dict, quantization: str | None,
                      row_inputs: dict[str, int]) -> None:
    """Before any rank starts: ValueError where a row-parallel layer's weight format cannot
    split its inputs over `size` ranks. `row_inputs`: each row-parallel projection's last
    name (o_proj, down_proj) -> its number of inputs. The formats: a kiln quantized
    checkpoint's own per-layer ones, else `quantization` (the loader's choice; each layer is
    checked again as it is built)."""
    layer_formats: dict[str, str] = (hf_config.get("quantization_config") or {}).get(
        "kiln_layer_formats", {})
    wanted = {(fmt, row_inputs[name.rsplit(".", 1)[-1]]) for name, fmt in layer_formats.items()
              if name.rsplit(".", 1)[-1] in row_inputs and fmt != "dense"}
    if not layer_formats and quantization is not None:
        wanted = {(quantization, n) for n in row_inputs.values()}
    for name, in_features in sorted(wanted):
        check_row_shardable(get_linear_method(name), in_features, size)


class RowParallel:
    """A LinearMethod keeping input columns `cols` of W; `apply` all-reduces the partial sums.
    The bias joins once, on rank 0 (the other ranks keep it zero). A method storing its own
    format splits its tensors itself (`rank_columns`): a quantized weight keeps its rows' and
    groups' scales as one process has them (kiln.quant.sharding)."""

    def __init__(self, inner: LinearMethod, cols: slice, comm: Communicator):
        check_row_shardable(inner, (cols.stop - cols.start) * comm.world_size, comm.world_size)
        self.inner, self.cols, self.comm = inner, cols, comm

    def create_weights(self, layer, in_features, out_shards, bias, dtype):
        self.inner.create_weights(layer, in_features, out_shards, bias, dtype)

    def load_shard(self, layer, shard, name, tensor):
        if name == "bias":
            if self.comm.rank == 0:
                self.inner.load_shard(layer, shard, name, tensor)
            return
        split = getattr(self.inner, "rank_columns", None)
        parts = ({name: self._columns(name, tensor)} if split is None
                 else split(name, tensor, self.cols))
        for key, value in parts.items():
            self.inner.load_shard(layer, shard, key, value)

    def _columns(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a dense weight."""
        if name == "weight" and tensor.dim() == 2:
            return tensor[:, self.cols]
        raise ValueError(f"row-parallel linear: cannot split checkpoint tensor {name!r} "
                         f"{tuple(tensor.shape)} by input columns")

    def finalize(self, layer):
        self.inner.finalize(layer)

    def apply(self, layer, x):
        return self.comm.all_reduce_(self.inner.apply(layer, x))

    def apply_fp32(self, layer, x):
        return self.comm.all_reduce_(self.inner.apply_fp32(layer, x))

    def stack_tensors(self, layer) -> StackTensors | None:
        """The format's tensors (this rank's columns) with the group that sums the output;
        None over gloo, which the stack cannot call. A bias would be added on rank 0 before
        the sum, as `apply` does, but no format hands the stack a layer with a bias."""
        inner = self.inner.stack_tensors(layer)
        if inner is None or not isinstance(self.comm, ShmCommunicator):
            return None
        return dataclasses.replace(inner, all_reduce=self.comm)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the token embedding [ceil(V / T), H]; a lookup of a token another
    rank holds gives zeros here, and the all-reduce sums in the rank's row that has it."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: TensorParallel):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = tp.vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.zeros(tp.vocab_per_rank(vocab_size), hidden_size,
                                               dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.rows.start
        elsewhere = (local < 0) | (local >= self.rows.stop - self.rows.start)
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        out.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.comm.all_reduce_(out)

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """The loader's hook for a module that keeps part of a checkpoint tensor."""
        if name != "weight" or tensor.shape != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"embedding: checkpoint tensor {name!r} {tuple(tensor.shape)}, "
                             f"expected weight {(self.vocab_size, self.weight.shape[1])}")
        with torch.no_grad():
            self.weight.copy_(take_rows(tensor, self.rows, self.weight.shape[0]))
