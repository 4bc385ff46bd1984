"""The model runner: SchedulerOutput -> RunnerOutput. Owns the model, the KV cache and sampler.

The only place that builds batch tensors. One `execute` call: build the flat batch, run the
model once over every scheduled token, compute logits only for the rows that need them, then
sample (and verify draft tokens) and compute logprobs.

With tensor parallelism (`parallel.tensor_parallel_size` > 1) this runner is rank 0: it
starts the other ranks (kiln.runner.rank_loop) and tells them each step before running its
own part; a following rank's runner (built with `ranks`) runs `follow_step` instead. With
pipeline parallelism (`pipeline_parallel_size` > 1) each rank holds one stage's layers and
runs them through kiln.runner.pipeline; rank 0 is the last stage. With data-parallel
attention (`data_parallel_size` > 1) each rank runs its own requests whole and the ranks
share the experts (kiln.runner.data_parallel).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from kiln.config import CacheConfig, ModelConfig, ParallelConfig, default_num_threads
from kiln.distributed.communicator import RankFailure
from kiln.distributed.launch import RankGroup, default_threads_per_rank
from kiln.engine.contract import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from kiln.models.layers.attention import AttentionMetadata
from kiln.models.layers.expert_parallel import ExpertParallelOptions, check_expert_parallel
from kiln.models.layers.kv_layout import CacheHolds, CacheLayout, model_cache_layout
from kiln.models.layers.linear import use_kernels
from kiln.models.layers.ops import ops_for
from kiln.models.layers.parallel import (
    SINGLE,
    TensorParallel,
    check_row_formats,
    check_tensor_parallel,
)
from kiln.models.loader import load_model, read_hf_config
from kiln.models.registry import resolve_architecture
from kiln.platform import KernelSet, Platform
from kiln.runner import fused_stack
from kiln.runner.attention import get_attention_backend
from kiln.runner.batch import BatchInputs, LogitsRows, build_batch
from kiln.runner.cuda_graphs import DecodeGraphs, GraphBackend, capture_sizes
from kiln.runner.data_parallel import (
    DataParallelAttention,
    attention_parallel,
    check_data_parallel,
)
from kiln.runner.device_memory import DeviceMemory, activation_reserve, gpu_kv_blocks, measure
from kiln.runner.hooks import NoGrammar, StepGrammar, StepGrammarFactory, VerifyShortlist
from kiln.runner.pipeline import (
    StageRunner,
    check_stages,
    kv_budget_layers,
    num_micro_batches,
    pipeline_stage,
)
from kiln.runner.rank_loop import (
    AllocateKV,
    DataParallelStep,
    FinishStep,
    Leader,
    MoveSlots,
    RunStep,
    step_seqs,
)
from kiln.runner.sampler import Sampler, SamplingRow, compute_logprobs, take_rows
from kiln.runner.verify import VerifyGroup, verify

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class KVCacheSpec:
    """Every layer's cache: `layout.num_tensors` tensors [slots, num_kv_heads, head_dim]
    (K and V; one latent tensor for MLA: kiln.models.layers.kv_layout)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    holds: CacheHolds = CacheHolds.KEY_VALUE

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout(self.holds, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.layout.bytes_per_token(self.num_layers, self.dtype)


def num_kv_blocks(spec: KVCacheSpec, cache: CacheConfig, max_model_len: int,
                  max_num_seqs: int, device_memory: DeviceMemory | None = None) -> int:
    """Blocks that fit the configured budget; else, on a GPU (`device_memory` given), what
    gpu_memory_utilization leaves (kiln.runner.device_memory); else max_model_len x
    max_num_seqs tokens (capped)."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory // spec.bytes_per_block
    if device_memory is not None:
        return gpu_kv_blocks(device_memory, cache.gpu_memory_utilization, spec.bytes_per_block)
    wanted = -(-max_model_len // spec.block_size) * max_num_seqs
    return max(1, min(wanted, cache.max_kv_cache_memory // spec.bytes_per_block))


@dataclass
class SamplePlan:
    """A step's sampling rows: one `SamplingRow` per row, its row of the logits
    (`index`), and per request that samples its `VerifyGroup` and scheduled position."""

    rows: list[SamplingRow]
    index: list[int]
    groups: list[VerifyGroup]
    owners: list[int]
    grammar_rows: StepGrammar


@dataclass
class StepHidden:
    """The last step's batch and final hidden states [T, H], kept for a speculator."""

    batch: BatchInputs
    hidden: torch.Tensor
    # flat row of each token's hidden state, where a draft tree's accepted path was moved
    # into place (path node j's row holds the state of the draft accepted at depth j); None:
    # every row is its own
    rows: torch.Tensor | None = None

    def physical(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.rows is None else self.rows[flat]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_path: str, cache: CacheConfig,
                 parallel: ParallelConfig, eos_token_ids: frozenset[int],
                 ranks: RankGroup | None = None):
        """`ranks`: this is a following rank of a tensor-parallel engine (rank_loop.main)."""
        size = parallel.world_size
        torch.set_num_threads(parallel.num_threads or (
            default_num_threads() if size == 1 else default_threads_per_rank(
                parallel.ranks_per_node)))
        self.platform = Platform.detect(model_config)
        log.info("platform: %s", self.platform.describe())
        self.dtype, self.device = self.platform.dtype, self.platform.device
        self.ops = ops_for(self.platform.kernels)
        self.backend = get_attention_backend(self.platform.attention_backend)
        # rank 0 of several: start the others (their processes load their parts meanwhile)
        self.leader = self._start_ranks(model_config, model_path, cache, parallel, ranks)
        if self.leader is not None:
            ranks = self.leader.group
        tp = SINGLE if ranks is None or ranks.comm is None else TensorParallel(
            ranks.comm, ExpertParallelOptions.from_parallel(parallel))
        exchange = None
        if parallel.data_parallel_size > 1:  # attention whole per rank, experts shared
            tp, exchange = attention_parallel(parallel, ranks.comm)
        pipe = None if ranks is None else ranks.pipe
        loaded = load_model(model_path, self.dtype, self.backend, model_config.quantization,
                            self.platform.linear_backend, self.ops,
                            tp=None if ranks is None else tp,
                            stage=None if pipe is None else pipeline_stage(
                                parallel, pipe.stage, model_path))
        # built and loaded on the CPU (the LinearMethod contract), then on the platform's device
        self.model, self.hf_config = loaded.model.to(self.device), loaded.hf_config
        use_kernels(self.model, self.platform.kernels)  # e.g. quantized linears' Triton GEMV
        # the decoder stack as one call where the platform and every layer allow it (each
        # tensor-parallel rank its shard; pipeline stages run their layers one call each)
        self.stack = self._stack_weights() if pipe is None else None
        self.fused_steps = 0  # steps the fused stack ran (tests, benchmarks/tp_decode.py)
        arch = self.model.arch
        self.vocab_size = arch.vocab_size
        layout = model_cache_layout(self.model, tp.heads(arch.num_heads, arch.num_kv_heads).kv,
                                    arch.head_dim)
        self.kv_spec = KVCacheSpec(arch.num_layers, layout.num_heads, layout.head_dim,
                                   self.dtype, cache.block_size, layout.holds)
        self.kv_layers = arch.num_layers  # layers this rank allocates KV for
        # pipeline parallelism: this rank's stage of each step (kiln.runner.pipeline)
        self.stages = None if pipe is None else StageRunner(
            self.model, self.backend, pipe, num_micro_batches(parallel), cache.block_size,
            self.device, self.dtype)
        if self.stages is not None:  # KV for its layers, blocks sized for the largest stage
            self.kv_layers = len(self.model.stage.layers)
            self.kv_spec = dataclasses.replace(
                self.kv_spec, num_layers=kv_budget_layers(parallel, arch))
        self.finishes_told = 0  # rank 0 of a pipeline: steps submitted with finish_oldest
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []  # per layer: (K, V) or (latent,)
        # data-parallel attention: this rank's side of each step (its own requests)
        self.data_parallel = None if exchange is None else DataParallelAttention(
            exchange, self.model, self._forward_batch, self.dtype, self.device)
        self.sampler = Sampler(arch.vocab_size, eos_token_ids, model_config.seed, self.device)
        self._generators: dict[str, torch.Generator] = {}
        self.keep_hidden = False  # set by kiln.speculative proposers that read hidden states
        # set by kiln.speculative proposers with a draft vocabulary: greedy verify steps score the
        # whole vocabulary only on the rows the walk visits (kiln.speculative.shortlist)
        self.shortlist: VerifyShortlist | None = None
        # set by the composition root: each step's grammar bitmask (kiln.structured.bitmask)
        self.grammar_rows: StepGrammarFactory = NoGrammar
        self.last_step: StepHidden | None = None
        # CUDA graphs for decode steps (kiln.runner.cuda_graphs): on a GPU unless
        # enforce_eager, with a backend that can be captured; their padding rows write to a
        # scratch block allocated past the pool's blocks
        self.use_graphs = (self.device.type == "cuda" and not model_config.enforce_eager
                           and isinstance(self.backend, GraphBackend) and self.stages is None
                           and self.data_parallel is None)
        self.graphs: DecodeGraphs | None = None

    @staticmethod
    def _start_ranks(model_config: ModelConfig, model_path: str, cache: CacheConfig,
                     parallel: ParallelConfig, ranks: RankGroup | None) -> Leader | None:
        """Rank 0 of a tensor-parallel engine: check the model splits (before any process
        starts), start the other ranks and join them. None for one process or a follower."""
        size = parallel.world_size
        if size == 1 or ranks is not None:
            return None
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
        return Leader.start(model_config, model_path, cache, parallel)

    @property
    def pipeline_depth(self) -> int:
        """Steps the engine may keep in flight (kiln.engine.pipelined): one per stage on
        rank 0 of a pipeline, else 1."""
        if self.stages is None or self.leader is None:
            return 1
        return self.stages.stage.count

    def submit(self, sched: SchedulerOutput, finish_oldest: bool = True) -> None:
        """Pipeline parallelism: start `sched` down the stages now; `execute(sched)` finishes
        it here later, steps in the order submitted. `finish_oldest`: the next step this rank
        runs is the oldest submitted, at once (the last stage's other tensor-parallel ranks,
        which run each step with this one, are told so with this step; else a FinishStep
        tells them when). With tensor-parallel stages, they also compute their share of the
        step's logits rows."""
        rows = (build_batch(sched, torch.device("cpu")).logits_index.tolist() if self.model.tp.size > 1
                else None)
        self.leader.send(RunStep(step_seqs(sched), rows, finish_oldest))
        self.finishes_told += int(finish_oldest)
        self.stages.post(sched)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do in one process)."""
        if self.leader is not None:
            self.leader.close()

    def _stack_weights(self) -> fused_stack.StackWeights | None:
        if not self.platform.fused_stack or os.environ.get("KILN_DISABLE_FUSED_STACK"):
            return None  # (the variable: benchmarks and tests, for the per-layer path)
        stack = fused_stack.stack_weights(self.model, self.backend)
        if stack is None:
            log.info("decoder layers run one call each (a layer is off the fused path, or "
                     "tensor-parallel ranks sum over gloo: see "
                     "kiln.runner.fused_stack.stack_weights)")
        return stack

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's cache once: K and V, [num_blocks * block_size, Hkv, D]
        each (one latent tensor for MLA: kv_spec.layout).
        Left uninitialized, so the OS maps pages only as blocks are first written; attention
        reads only written slots, except padded lanes of the reference path, which read slot 0
        (masked out, but 0 x NaN would still be NaN): so block 0 is zeroed."""
        if self.leader is not None:
            self.leader.send(AllocateKV(num_blocks))
        s = self.kv_spec
        log.info("KV cache: %d blocks of %d tokens, %s, %d bytes per token", num_blocks,
                 s.block_size, s.holds.value, s.bytes_per_block // s.block_size)
        self.graphs, self.pool_blocks = None, num_blocks  # graphs hold the old caches
        shape = ((num_blocks + self.use_graphs) * s.block_size, s.num_kv_heads, s.head_dim)
        self.kv_caches = []
        for _ in range(self.kv_layers):
            tensors = tuple(torch.empty(shape, dtype=s.dtype, device=self.device)
                            for _ in range(s.layout.num_tensors))
            for t in tensors:
                t[:s.block_size].zero_()
            self.kv_caches.append(tensors)

    def device_memory(self, max_num_batched_tokens: int, max_num_seqs: int
                      ) -> DeviceMemory | None:
        """On a GPU, its memory now that the weights are loaded, with a reserve for a step of
        `max_num_batched_tokens` tokens sampling `max_num_seqs` rows; None on the CPU."""
        if self.device.type != "cuda":
            return None
        a = self.model.arch
        reserve = activation_reserve(
            a.hidden_size, a.intermediate_size, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim,
            a.vocab_size, max_num_batched_tokens, max_num_seqs, self.dtype.itemsize)
        torch.cuda.empty_cache()  # what the load freed counts as free
        return measure(self.device, self.model, reserve)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int,
                       capture: bool = True) -> None:
        """CUDA graphs for decode steps of up to max_num_seqs sequences (after
        allocate_kv_cache); capture=False runs the same padded steps eagerly (CPU tests)."""
        if capture and not self.use_graphs:
            return
        bs = self.kv_spec.block_size
        self.graphs = DecodeGraphs(
            lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta), self.backend,
            capture_sizes(max_num_seqs), -(-max_model_len // bs), self.pool_blocks, bs,
            self.device, self.model, capture)
        with torch.inference_mode():
            self.graphs.capture()

    def release(self, request_ids: list[str]) -> None:
        """Drop per-request state of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)

    # -- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput,
                logits: bool = False) -> tuple[BatchInputs, torch.Tensor]:
        """The step's batch and final hidden states [T, H] (KV written), before the LM head:
        `execute` samples from them; a draft model's proposer scores a draft vocabulary.
        `logits`: the LM head runs next on the batch's logits rows (the other ranks join)."""
        self.release(sched.finished_ids)
        batch = build_batch(sched, self.device, self.kv_spec.block_size)
        if self.stages is not None:  # this rank's stage over the step's micro-batches
            if self.leader is not None:
                self._tell_finish(sched)
            return batch, self.stages.run(sched, self.kv_caches)
        if self.leader is not None:
            rows = batch.logits_index.tolist() if logits else None
            self.leader.send(RunStep(step_seqs(sched), rows))
        size = self.graphs.bucket(sched, batch) if self.graphs is not None else None
        if size is not None:
            return batch, self.graphs.run(batch, batch.slot_mapping, size)
        meta = self.backend.build_metadata(batch.layout, batch.slot_positions,
                                           self.kv_spec.block_size, batch.slot_mapping)
        return batch, self._run_model(batch, meta)

    def _tell_finish(self, sched: SchedulerOutput) -> None:
        """Rank 0 of a pipeline, about to run `sched` on its stage: the last stage's other
        tensor-parallel ranks must run it now too (submitted here if it was not)."""
        if not self.stages.is_posted(sched):
            self.submit(sched)
        if self.model.tp.size > 1 and not self.finishes_told:
            self.leader.send(FinishStep())
        self.finishes_told = max(0, self.finishes_told - 1)

    @torch.inference_mode()
    def follow_data_parallel(self, step: DataParallelStep) -> None:
        """A following rank's share of a data-parallel step: its own sequences."""
        self.data_parallel.follow(step)

    def _forward_batch(self, batch: BatchInputs) -> torch.Tensor:
        """The final hidden states [T, H] of this rank's `batch` (data-parallel attention)."""
        meta = self.backend.build_metadata(batch.layout, batch.slot_positions,
                                           self.kv_spec.block_size)
        return self._run_model(batch, meta)

    @torch.inference_mode()
    def follow_step(self, sched: SchedulerOutput, logits_index: list[int] | None,
                    finish: bool = True) -> None:
        """A following rank's share of rank 0's step: the forward, then its LM head rows.
        The last stage's other tensor-parallel ranks begin it, and run their oldest step
        begun when rank 0 runs it (`finish`, or a later FinishStep: `follow_finish`)."""
        if self._runs_with_leader():
            self.stages.post(sched, logits_index)
            if finish:
                self.stages.run_oldest(self.kv_caches)
            return
        _, hidden = self.forward(sched)
        if logits_index is not None and hidden is not None:  # (None: not the last stage)
            self.model.compute_logits(hidden[torch.tensor(logits_index, dtype=torch.int64)])

    @torch.inference_mode()
    def follow_finish(self) -> None:
        if self._runs_with_leader():
            self.stages.run_oldest(self.kv_caches)

    def _runs_with_leader(self) -> bool:
        """A following rank of the last stage at tensor parallelism: it runs each step when
        rank 0 does, in the same model group."""
        return (self.stages is not None and self.leader is None and self.model.tp.size > 1
                and self.stages.stage.is_last)

    def _run_model(self, batch: BatchInputs, meta: AttentionMetadata) -> torch.Tensor:
        """The fused stack where it serves this step, else the model's per-layer forward
        (the same bits either way)."""
        if self.stack is not None and self.stack.serves(meta):
            self.fused_steps += 1
            return fused_stack.fused_stack(self.stack, batch.input_ids, batch.positions,
                                           self.kv_caches, meta)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, meta)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        try:
            return self._execute(sched)
        except RankFailure as exc:
            if self.leader is None:
                raise
            raise self.leader.fail(exc) from exc  # the engine cannot go on: stop the others

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if self.data_parallel is not None:
            return self._execute_data_parallel(sched)
        batch, hidden = self.forward(sched, logits=True)
        if self.keep_hidden:  # a speculator (kiln.speculative) reads this step's hidden states
            self.last_step = StepHidden(batch, hidden)
        plan = self._plan(sched.scheduled, batch.rows)
        if self._shortlisted(sched, plan):
            return self._outputs_shortlisted(sched, batch, hidden, plan)
        logits = self.model.compute_logits(hidden[batch.logits_index]).float()
        return self._outputs(sched, batch, logits, plan)

    def _execute_data_parallel(self, sched: SchedulerOutput) -> RunnerOutput:
        """Every rank runs its own requests; rank 0 samples the gathered logits (no draft
        trees: speculative decoding is refused with data-parallel attention)."""
        self.release(sched.finished_ids)
        rows, logits = self.data_parallel.lead(sched, self.leader)
        plan = self._plan(sched.scheduled, rows)
        sampled, logprobs, _ = self._sample(sched.scheduled, plan, logits)
        return RunnerOutput(sampled, logprobs, self._step_prompt_logprobs(sched, rows, logits))

    def _shortlisted(self, sched: SchedulerOutput, plan: SamplePlan) -> bool:
        """Whether the step is a greedy verify step the shortlist serves."""
        if self.shortlist is None:
            return False
        prompt_lp_or_grammar = any(item.prompt_logprobs or item.grammar is not None
                                   for item in sched.scheduled)
        return self.shortlist.applies(plan.rows, plan.groups, prompt_lp_or_grammar)

    def _outputs_shortlisted(self, sched: SchedulerOutput, batch: BatchInputs,
                             hidden: torch.Tensor, plan: SamplePlan) -> RunnerOutput:
        """A greedy verify step's outputs with the LM head on the rows the walk visits
        only (kiln.speculative.shortlist)."""
        tokens, paths = self.shortlist.verify(
            hidden[batch.logits_index[plan.index]], plan.rows, plan.groups, self.sampler,
            self.model.compute_logits)
        result: list[list[int]] = [[] for _ in sched.scheduled]
        owned: list[list[int] | None] = [None] * len(sched.scheduled)
        for owner, toks, path in zip(plan.owners, tokens, paths, strict=True):
            result[owner], owned[owner] = toks, path
        if any(path for path in owned):
            self._compact(sched, batch, owned)
        return RunnerOutput(result, None, None)

    def _outputs(self, sched: SchedulerOutput, batch: BatchInputs, logits: torch.Tensor,
                 plan: SamplePlan) -> RunnerOutput:
        sampled, logprobs, paths = self._sample(sched.scheduled, plan, logits)
        if any(path for path in paths):
            self._compact(sched, batch, paths)
        return RunnerOutput(sampled, logprobs,
                            self._step_prompt_logprobs(sched, batch.rows, logits))

    def _step_prompt_logprobs(self, sched: SchedulerOutput, rows: list[LogitsRows],
                              logits: torch.Tensor) -> list[list[TokenLogprobs] | None] | None:
        if not any(item.prompt_logprobs for item in sched.scheduled):
            return None
        return [self._prompt_logprobs(item, r, logits)
                for item, r in zip(sched.scheduled, rows, strict=True)]

    def _compact(self, sched: SchedulerOutput, batch: BatchInputs,
                 paths: list[list[int] | None]) -> None:
        """Draft trees: move the KV of each accepted path (draft c accepted at depth j sat in
        slot r + 1 + c, r the root's position) to the slots of its positions r + 1 + j, in
        every layer, so the cache reads as if the path alone had been computed; the
        scheduler then trims past it. A kept step's hidden rows are remapped alike."""
        bs = self.kv_spec.block_size
        src, dst, row_src, row_dst = [], [], [], []
        for item, path, q_start in zip(sched.scheduled, paths, batch.layout.query_start.tolist(),
                                       strict=True):
            if not path:
                continue
            root = len(item.token_ids) - 1 - item.num_draft_tokens
            for j, c in enumerate(path):
                if c == j:
                    continue
                for pos, out in ((item.start_pos + root + 1 + c, src),
                                 (item.start_pos + root + 1 + j, dst)):
                    out.append(item.block_ids[pos // bs] * bs + pos % bs)
                row_src.append(q_start + root + 1 + c)
                row_dst.append(q_start + root + 1 + j)
        if not src:
            return
        if self.leader is not None:
            self.leader.send(MoveSlots(src, dst))
        self.move_slots(torch.tensor(src, device=self.device),
                        torch.tensor(dst, device=self.device))
        step = self.last_step
        if step is not None and step.batch is batch:
            rows = torch.arange(len(batch.input_ids), device=self.device)
            rows[torch.tensor(row_dst, device=self.device)] = torch.tensor(row_src,
                                                                           device=self.device)
            step.rows = rows

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K and V from slots `src` to `dst` (gathered, then written)."""
        if self.platform.kernels is KernelSet.CPP:  # one call for every layer
            torch.ops.kiln.move_slots([c for kv in self.kv_caches for c in kv], src, dst)
        else:
            for cache in (t for layer in self.kv_caches for t in layer):
                cache[dst] = cache[src]

    def _plan(self, scheduled: list[ScheduledRequest], rows: list[LogitsRows]) -> SamplePlan:
        """The step's sampling rows: a request with drafts has 1 + k of them."""
        plan = SamplePlan([], [], [], [], self.grammar_rows(self.vocab_size))
        for i, (item, r) in enumerate(zip(scheduled, rows, strict=True)):
            if not r.num_sample:
                continue
            drafts = item.token_ids[len(item.token_ids) - item.num_draft_tokens:]
            parents = item.draft_parents if drafts else None
            plan.groups.append(VerifyGroup(len(plan.rows), drafts, item.draft_probs, parents))
            # kiln.structured: the step's bitmask (trees have no grammar)
            plan.grammar_rows.add(item.grammar, len(plan.rows), drafts)
            plan.owners.append(i)
            for j in range(r.num_sample):
                plan.rows.append(self._row(item, _draft_history(drafts, parents, j)))
                plan.index.append(r.sample_start + j)
        return plan

    def _sample(self, scheduled: list[ScheduledRequest], plan: SamplePlan,
                logits: torch.Tensor):
        """Sample each request's row; a request with drafts has 1 + k rows, and
        kiln.runner.verify decides which drafts stand and adds one token after them."""
        result = [[] for _ in scheduled]
        paths: list[list[int] | None] = [None] * len(scheduled)
        want_logprobs = any(item.params.logprobs is not None for item in scheduled)
        lp_result = [[] for _ in scheduled] if want_logprobs else None
        if not plan.rows:
            return result, lp_result, paths
        out = verify(self.sampler, take_rows(logits, plan.index), plan.rows, plan.groups,
                     bitmask=plan.grammar_rows.fill(plan.rows))
        for g, owner in enumerate(plan.owners):
            result[owner] = out.token_ids[g]
            paths[owner] = out.paths[g]
            if lp_result is not None and scheduled[owner].params.logprobs is not None:
                lp_result[owner] = out.logprobs[g]
        return result, lp_result, paths

    def _row(self, item: ScheduledRequest, drafts_before: list[int]) -> SamplingRow:
        gen = None
        if item.params.seed is not None:
            gen = self._generators.get(item.request_id)
            if gen is None:
                gen = torch.Generator(self.device).manual_seed(item.params.seed)
                self._generators[item.request_id] = gen
        history = item.output_token_ids + drafts_before if drafts_before else item.output_token_ids
        return SamplingRow(item.params, item.prompt_token_ids, history, gen)

    def _prompt_logprobs(self, item: ScheduledRequest, rows: LogitsRows,
                         logits: torch.Tensor) -> list[TokenLogprobs] | None:
        if not rows.num_prompt:
            return None
        lo = rows.prompt_start
        targets = torch.tensor(
            item.prompt_token_ids[item.start_pos + 1:item.start_pos + 1 + rows.num_prompt],
            device=logits.device)
        return compute_logprobs(logits[lo:lo + rows.num_prompt], targets,
                                item.params.prompt_logprobs or 0)


def _draft_history(drafts: list[int], parents: list[int] | None, row: int) -> list[int]:
    """The drafts before sampling row `row` (row 0: none): a chain's first `row`, a tree's
    path from the root to draft row - 1."""
    if parents is None or not row:
        return drafts[:row]
    path, node = [], row - 1
    while node >= 0:
        path.append(drafts[node])
        node = parents[node]
    return path[::-1]
