"""Mixture-of-experts layers over tensor-parallel ranks, and the per-expert load they measure.

Attention stays tensor-parallel (heads split over the T ranks, one all-reduce after o_proj),
so every rank holds every token's hidden state when a sparse block starts. The experts then
split one of two ways (docs/moe.md, "Expert parallelism"):

- **experts tensor-parallel** (default, as vLLM without `--enable-expert-parallel`): each
  expert's gate/up is column-split and its down row-split over the ranks, exactly as the
  dense MLP; every rank runs every routed (token, expert) pair on its columns.
- **expert parallelism** (`enable_expert_parallel`): whole experts live on ranks; a rank
  runs only the pairs routed to experts it holds. The tokens are already on every rank, so
  no all-to-all is needed: each rank's partial sum joins the block's all-reduce.

Either way the router is replicated (every rank routes identically), the shared experts are
split by columns, and the block ends with ONE all-reduce of [T, H] covering the routed and
shared experts' partial sums (the experts' down projections do not reduce on their own:
`PartialRowParallel`).

Placement (`place_experts`): expert e's copies go to ranks by greedy packing on the measured
load (a load file; without one every expert weighs the same, which is plain round-robin,
expert e on rank e mod T). Round-robin rather than contiguous ranges because there is no
all-to-all to save here: striding spreads each of a grouped router's expert groups (and any
run of correlated neighbours) over all ranks, which balances a step's work. With
`num_redundant_experts` K the K extra copies go to the hottest experts (highest load per
copy), and a routed pair (token t, expert e) is computed by copy t mod c_e of e's c_e copies:
a fixed rule, so the tokens are the same as one rank's whatever the placement.

Under data-parallel attention (`ExpertParallelOptions.data_parallel`) attention is not split
and each rank holds only its own tokens: the experts then span the data-parallel ranks, the
block first gathers every rank's tokens (`ExpertShard.gather`) and each rank keeps its own
rows of the all-reduce (`ExpertShard.reduce`); kiln.distributed.dp_attention. With
`all2all_backend="alltoall"` the block instead dispatches each rank's own routed tokens to
the ranks computing their pairs and combines the partial sums back (`ExpertShard.dispatch`,
kiln.distributed.expert_dispatch; the shared experts then stay whole on every rank).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.distributed.dp_attention import TokenExchange
from kiln.distributed.expert_dispatch import ExpertDispatch
from kiln.models.layers.linear import LinearMethod
from kiln.models.layers.parallel import ColumnParallel, RowParallel, TensorParallel


@dataclass(frozen=True)
class ExpertParallelOptions:
    """How a tensor-parallel engine places a MoE model's experts (ParallelConfig's fields)."""

    enabled: bool = False  # whole experts on ranks (else every expert split by columns)
    num_redundant_experts: int = 0  # extra copies of the hottest experts (enabled only)
    load_file: str | None = None  # ExpertLoad JSON the placement follows (None: uniform)
    # data-parallel attention: the experts span the data-parallel ranks, whose tokens this
    # exchanges around each block (kiln.distributed.dp_attention); None: the tensor-parallel
    # ranks, which already hold every token
    data_parallel: TokenExchange | None = None
    # the data-parallel ranks dispatch routed pairs all-to-all (all2all_backend "alltoall"):
    # the shared experts stay whole on each rank
    all_to_all: bool = False

    @classmethod
    def from_parallel(cls, parallel) -> ExpertParallelOptions:
        """From a kiln.config.ParallelConfig."""
        return cls(parallel.enable_expert_parallel, parallel.num_redundant_experts,
                   parallel.expert_load_file,
                   all_to_all=parallel.all2all_backend == "alltoall")


# -- placement --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where the copies of each of E experts live over T ranks."""

    num_ranks: int
    ranks_of: tuple[tuple[int, ...], ...]  # expert e -> ranks holding its copies, copy order

    def experts_on(self, rank: int) -> tuple[int, ...]:
        return tuple(e for e, ranks in enumerate(self.ranks_of) if rank in ranks)

    def copy_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """copies [E] int64 (c_e) and copy_rank [E, max c] int64 (the rank of copy i of e;
        padded with the first copy's rank)."""
        width = max(len(r) for r in self.ranks_of)
        table = [list(r) + [r[0]] * (width - len(r)) for r in self.ranks_of]
        return (torch.tensor([len(r) for r in self.ranks_of], dtype=torch.int64),
                torch.tensor(table, dtype=torch.int64))


def check_placement(num_experts: int, num_ranks: int, num_redundant: int,
                    size_name: str = "tensor_parallel_size") -> None:
    """ValueError naming the numbers unless E experts plus K copies fill T ranks evenly (every
    rank the same number of expert slots) with at most one copy of an expert per rank."""
    slots = num_experts + num_redundant
    if slots % num_ranks:
        raise ValueError(f"expert parallelism: {num_experts} experts + {num_redundant} "
                         f"redundant copies = {slots} expert slots, not divisible by "
                         f"{size_name} {num_ranks}")
    most = num_experts * (num_ranks - 1)
    if num_redundant > most:
        raise ValueError(f"num_redundant_experts {num_redundant} is more than the {most} "
                         f"copies {num_experts} experts can have over {num_ranks} ranks "
                         f"(at most one copy of an expert per rank)")


def place_experts(load: Sequence[float], num_ranks: int, num_redundant: int = 0) -> Placement:
    """Copies: K times, one more copy for the expert with the most load per copy. Ranks: the
    experts with most copies first, then by load per copy, each copy on the least-loaded rank
    that has a free slot and no copy of it yet (ties: the lower rank), as EPLB packs."""
    check_placement(len(load), num_ranks, num_redundant)
    copies = _copy_counts(load, num_ranks, num_redundant)
    free = [(len(load) + num_redundant) // num_ranks] * num_ranks
    rank_load = [0.0] * num_ranks
    ranks_of: list[list[int]] = [[] for _ in load]
    for e in sorted(range(len(load)), key=lambda e: (-copies[e], -load[e] / copies[e], e)):
        for _ in range(copies[e]):
            open_ranks = [r for r in range(num_ranks) if free[r] and r not in ranks_of[e]]
            if not open_ranks:
                raise ValueError(f"expert parallelism: no rank left for a copy of expert {e} "
                                 f"({copies[e]} copies over {num_ranks} ranks)")
            rank = min(open_ranks, key=lambda r: (rank_load[r], r))
            ranks_of[e].append(rank)
            free[rank] -= 1
            rank_load[rank] += load[e] / copies[e]
    return Placement(num_ranks, tuple(tuple(r) for r in ranks_of))


def _copy_counts(load: Sequence[float], num_ranks: int, num_redundant: int) -> list[int]:
    copies = [1] * len(load)
    for _ in range(num_redundant):
        hottest = max((e for e in range(len(load)) if copies[e] < num_ranks),
                      key=lambda e: (load[e] / copies[e], -e))
        copies[hottest] += 1
    return copies


# -- one rank's share of a block ---------------------------------------------------------------

@dataclass(frozen=True)
class ExpertShard:
    """One rank's part of one sparse block: all experts split by columns (placement None; in
    one process, simply all experts), or the whole experts `placement` puts on this rank."""

    tp: TensorParallel
    placement: Placement | None = None
    exchange: TokenExchange | None = None  # data-parallel attention (else tokens replicated)

    @property
    def expert_parallel(self) -> bool:
        return self.placement is not None

    def held_experts(self, num_experts: int) -> tuple[int, ...]:
        if self.placement is None:
            return tuple(range(num_experts))
        return self.placement.experts_on(self.tp.rank)

    def expert_columns(self) -> TensorParallel | None:
        """The split of a routed expert's columns (None: whole experts, no split)."""
        return None if self.expert_parallel or self.tp.comm is None else self.tp

    @property
    def dispatch(self) -> ExpertDispatch | None:
        """The all-to-all exchange where the data-parallel ranks use it (else None)."""
        return None if self.exchange is None else self.exchange.dispatch

    def shared_columns(self) -> TensorParallel | None:
        """The split of the shared experts' columns (None: whole on this rank). Split over
        the ranks whose partial sums the block all-reduces; whole under the all-to-all
        exchange, where each rank computes its own tokens' shared experts."""
        return None if self.tp.comm is None or self.dispatch is not None else self.tp

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens the block runs on: under data-parallel attention every rank's (this
        rank's rows [n_r, H] -> [N, H]), else `x` (already every token)."""
        return x if self.exchange is None else self.exchange.gather(x)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The block's one all-reduce of the ranks' partial sums (nothing in one process);
        under data-parallel attention, this rank's rows of the sum."""
        if self.exchange is not None:
            return self.exchange.reduce_own(partial)
        return partial if self.tp.comm is None else self.tp.comm.all_reduce_(partial)


def expert_shard(tp: TensorParallel, layer: int, num_experts: int) -> ExpertShard:
    """Layer `layer`'s ExpertShard for rank tp.rank, following the options `tp` carries."""
    options: ExpertParallelOptions | None = getattr(tp, "experts", None)
    exchange = None if options is None else options.data_parallel
    if exchange is not None:  # attention whole per rank; the experts over the DP ranks
        tp = TensorParallel(exchange.comm, options)
    if tp.comm is None or options is None or not options.enabled:
        return ExpertShard(tp, exchange=exchange)
    load = layer_load(options.load_file, layer, num_experts)
    return ExpertShard(tp, place_experts(load, tp.size, options.num_redundant_experts),
                       exchange)


class PartialRowParallel(RowParallel):
    """A row-parallel expert projection that leaves its partial sum unreduced: the sparse
    block reduces once for all experts (ExpertShard.reduce), not once per expert."""

    def apply(self, layer, x):
        return self.inner.apply(layer, x)

    def apply_fp32(self, layer, x):
        return self.inner.apply_fp32(layer, x)


def split_expert_methods(cols_tp: TensorParallel | None, width: int, gate_up: LinearMethod,
                         down: LinearMethod) -> tuple[int, LinearMethod, LinearMethod]:
    """(this rank's width, gate/up method, down method) of a SwiGLU expert `width` wide:
    unchanged for a whole expert, else its share of the columns (down left unreduced)."""
    if cols_tp is None:
        return width, gate_up, down
    cols = cols_tp.part(width)
    return (cols.stop - cols.start, ColumnParallel(gate_up, (cols, cols)),
            PartialRowParallel(down, cols, cols_tp.comm))


def check_expert_parallel(moe, size: int, options: ExpertParallelOptions,
                          size_name: str = "tensor_parallel_size") -> None:
    """ValueError naming the numbers where a MoE block (`moe`: a kiln.models.layers.moe_config
    MoeShape) cannot be split over `size` ranks the way `options` asks; called at start,
    before any rank process starts. `size_name`: the setting that gave `size`."""
    shared = moe.shared_intermediate_size
    if shared and shared % size and not options.all_to_all:
        raise ValueError(f"{size_name} {size} does not divide the shared experts' "
                         f"intermediate size {shared}")
    num_experts = moe.router.num_experts
    if not options.enabled:
        if moe.expert_intermediate_size % size:
            raise ValueError(f"{size_name} {size} does not divide the experts' "
                             f"intermediate size {moe.expert_intermediate_size} (or place "
                             f"whole experts: enable_expert_parallel)")
        return
    check_placement(num_experts, size, options.num_redundant_experts, size_name)
    if options.load_file is not None:
        read_load_file(options.load_file).check_experts(num_experts)


# -- measured load -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertLoad:
    """Routed (token, expert) pairs per expert of each MoE layer since the engine started.
    `tokens[i]` is decoder layer `layers[i]`'s; `rank_tokens[i]` the pairs each rank computed
    there under expert parallelism (None otherwise: every rank computes every pair)."""

    layers: tuple[int, ...]
    tokens: torch.Tensor  # [L, E] int64
    rank_tokens: torch.Tensor | None = None  # [L, T] int64

    def expert_imbalance(self) -> torch.Tensor:
        """[L] max / mean tokens per expert (1.0: perfectly even; 0 where none routed)."""
        return _max_over_mean(self.tokens)

    def rank_imbalance(self) -> torch.Tensor | None:
        """[L] max / mean pairs per rank under expert parallelism, else None."""
        return None if self.rank_tokens is None else _max_over_mean(self.rank_tokens)

    def layer_tokens(self, layer: int) -> list[int] | None:
        if layer not in self.layers:
            return None
        return self.tokens[self.layers.index(layer)].tolist()

    def check_experts(self, num_experts: int) -> None:
        if self.tokens.shape[1] != num_experts:
            raise ValueError(f"expert load lists {self.tokens.shape[1]} experts per layer; "
                             f"the model has {num_experts}")

    def to_json(self) -> str:
        return json.dumps({"layers": list(self.layers), "tokens": self.tokens.tolist()})

    def save(self, path: str | Path) -> None:
        """Write the load file `expert_load_file` reads."""
        Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str) -> ExpertLoad:
        data = json.loads(text)
        layers, tokens = data.get("layers"), data.get("tokens")
        if not isinstance(layers, list) or not isinstance(tokens, list) or \
                len(layers) != len(tokens) or len({len(t) for t in tokens}) > 1:
            raise ValueError("expert load: need {'layers': [L ints], 'tokens': [L lists of "
                             "E counts]}")
        return cls(tuple(int(i) for i in layers), torch.tensor(tokens, dtype=torch.int64))


def _max_over_mean(counts: torch.Tensor) -> torch.Tensor:
    mean = counts.double().mean(dim=-1)
    ratio = counts.double().amax(dim=-1) / mean
    return torch.where(mean > 0, ratio, torch.zeros_like(ratio))


@functools.cache
def read_load_file(path: str) -> ExpertLoad:
    try:
        return ExpertLoad.from_json(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"expert_load_file {path!r}: {exc}") from exc


def layer_load(path: str | None, layer: int, num_experts: int) -> list[float]:
    """Layer `layer`'s measured tokens per expert from the load file (uniform without one, or
    for a layer it does not list)."""
    if path is None:
        return [1.0] * num_experts
    load = read_load_file(path)
    load.check_experts(num_experts)
    counts = load.layer_tokens(layer)
    return [1.0] * num_experts if counts is None else [float(c) for c in counts]


def experts_elsewhere(model: torch.nn.Module) -> tuple[str, ...]:
    """Checkpoint prefixes of the experts held by other ranks (expert parallelism), for the
    loader's `unused_checkpoint_prefixes`."""
    return tuple(prefix for module in model.modules() if hasattr(module, "elsewhere")
                 for prefix in module.elsewhere())


def model_expert_load(model: torch.nn.Module) -> ExpertLoad | None:
    """The expert load a model's sparse blocks counted (None: a dense model)."""
    return collect_expert_load([m for m in model.modules() if hasattr(m, "expert_tokens")])


def collect_expert_load(blocks: Sequence) -> ExpertLoad | None:
    """The load counted by a model's sparse blocks (kiln.models.layers.moe.SparseMoeBlock,
    each with `layer`, `expert_tokens` and `rank_tokens`); None for a model without any. Reads
    the device counters (one copy per layer), only when asked."""
    if not blocks:
        return None
    tokens = torch.stack([b.expert_tokens.cpu() for b in blocks])
    ranks = None
    if all(b.rank_tokens is not None for b in blocks):
        ranks = torch.stack([b.rank_tokens.cpu() for b in blocks])
    return ExpertLoad(tuple(b.layer for b in blocks), tokens, ranks)
