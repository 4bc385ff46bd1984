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

Beside it: kiln.runner.startup (threads, whether the model splits over the ranks, the fused
stack), kiln.runner.kv_cache (the cache's shape, tensors and slot moves) and
kiln.runner.step_sampling (a step's sampling rows, sampled and verified).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from kiln.config import CacheConfig, ModelConfig, ParallelConfig
from kiln.distributed.communicator import RankFailure
from kiln.distributed.dp_attention import TokenExchange
from kiln.distributed.launch import RankGroup
from kiln.distributed.pipe import StagePipe
from kiln.engine.contract import RunnerOutput, SchedulerOutput
from kiln.models.layers.attention import AttentionMetadata
from kiln.models.layers.expert_parallel import ExpertParallelOptions
from kiln.models.layers.kv_layout import model_cache_layout
from kiln.models.layers.linear import use_kernels
from kiln.models.layers.ops import ops_for
from kiln.models.layers.parallel import SINGLE, TensorParallel
from kiln.models.loader import load_model
from kiln.platform import KernelSet, Platform
from kiln.runner import fused_stack
from kiln.runner.attention import get_attention_backend
from kiln.runner.batch import BatchInputs, LogitsRows, build_batch
from kiln.runner.cuda_graphs import DecodeGraphs, GraphBackend, capture_sizes
from kiln.runner.data_parallel import DataParallelAttention, attention_parallel
from kiln.runner.device_memory import DeviceMemory, activation_reserve, measure
from kiln.runner.hooks import NoGrammar, StepGrammarFactory, VerifyShortlist
from kiln.runner.kv_cache import KVCacheSpec, allocate_kv_caches, move_kv_slots, path_moves
from kiln.runner.kv_io import KVCaches
from kiln.runner.pipeline import StageRunner, kv_budget_layers, num_micro_batches, pipeline_stage
from kiln.runner.rank_loop import (
    AllocateKV,
    DataParallelStep,
    FinishStep,
    Leader,
    MoveSlots,
    RunStep,
    step_seqs,
)
from kiln.runner.sampler import Sampler
from kiln.runner.startup import check_splits, fused_stack_weights, num_threads
from kiln.runner.step_sampling import (
    SamplePlan,
    StepSampling,
    greedy_tokens,
    plain_greedy,
    step_prompt_logprobs,
)

log = logging.getLogger(__name__)


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
        torch.set_num_threads(num_threads(parallel))
        self.platform = Platform.detect(model_config)
        log.info("platform: %s", self.platform.describe())
        self.dtype, self.device = self.platform.dtype, self.platform.device
        self.ops = ops_for(self.platform.kernels)
        self.backend = get_attention_backend(self.platform.attention_backend)
        # rank 0 of several: start the others (their processes load their parts meanwhile)
        self.leader = self._start_ranks(model_config, model_path, cache, parallel, ranks)
        if self.leader is not None:
            ranks = self.leader.group
        tp, exchange = self._model_split(parallel, ranks)
        pipe = None if ranks is None else ranks.pipe
        self._load(model_config, model_path, parallel, None if ranks is None else tp, pipe)
        self._plan_kv_cache(cache, parallel, tp, pipe)
        # data-parallel attention: this rank's side of each step (its own requests)
        self.data_parallel = None if exchange is None else DataParallelAttention(
            exchange, self.model, self._forward_batch, self.dtype, self.device)
        self.sampler = Sampler(self.vocab_size, eos_token_ids, model_config.seed, self.device)
        self.sampling = StepSampling(self.sampler, self.device)
        self._init_hooks()
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
        if parallel.world_size == 1 or ranks is not None:
            return None
        check_splits(model_config, model_path, parallel)
        return Leader.start(model_config, model_path, cache, parallel)

    @staticmethod
    def _model_split(parallel: ParallelConfig, ranks: RankGroup | None
                     ) -> tuple[TensorParallel, TokenExchange | None]:
        """This rank's share of the model: its tensor-parallel shard (SINGLE in one process);
        with data-parallel attention, attention whole per rank and the experts shared over the
        ranks, their tokens moved by the returned exchange."""
        if parallel.data_parallel_size > 1:
            return attention_parallel(parallel, ranks.comm)
        return SINGLE if ranks is None or ranks.comm is None else TensorParallel(
            ranks.comm, ExpertParallelOptions.from_parallel(parallel)), None

    def _load(self, model_config: ModelConfig, model_path: str, parallel: ParallelConfig,
              tp: TensorParallel | None, pipe: StagePipe | None) -> None:
        """Load this rank's part of the model (`tp`'s shard, `pipe`'s stage) and choose how
        its decoder stack runs."""
        loaded = load_model(model_path, self.dtype, self.backend, model_config.quantization,
                            self.platform.linear_backend, self.ops, tp=tp,
                            stage=None if pipe is None else pipeline_stage(
                                parallel, pipe.stage, model_path))
        # built and loaded on the CPU (the LinearMethod contract), then on the platform's device
        self.model, self.hf_config = loaded.model.to(self.device), loaded.hf_config
        use_kernels(self.model, self.platform.kernels)  # e.g. quantized linears' Triton GEMV
        # the decoder stack as one call where the platform and every layer allow it (each
        # tensor-parallel rank its shard; pipeline stages run their layers one call each)
        self.stack = (fused_stack_weights(self.platform, self.model, self.backend)
                      if pipe is None else None)
        self.fused_steps = 0  # steps the fused stack ran (tests, benchmarks/tp_decode.py)
        self.vocab_size = self.model.arch.vocab_size

    def _plan_kv_cache(self, cache: CacheConfig, parallel: ParallelConfig, tp: TensorParallel,
                       pipe: StagePipe | None) -> None:
        """The KV cache's shape (allocated later: allocate_kv_cache): this rank's KV heads of
        each of its layers; with pipeline stages, the stage's layers, and the StageRunner."""
        arch = self.model.arch
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
        self.kv_caches: KVCaches = []  # per layer: (K, V) or (latent,)

    def _init_hooks(self) -> None:
        """What features set after construction; each off until one does."""
        self.keep_hidden = False  # set by kiln.speculative proposers that read hidden states
        # set by kiln.speculative proposers with a draft vocabulary: greedy verify steps score the
        # whole vocabulary only on the rows the walk visits (kiln.speculative.shortlist)
        self.shortlist: VerifyShortlist | None = None
        # set by the composition root: each step's grammar bitmask (kiln.structured.bitmask)
        self.grammar_rows: StepGrammarFactory = NoGrammar
        self.last_step: StepHidden | None = None

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

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's cache once: K and V, [num_blocks * block_size, Hkv, D]
        each (one latent tensor for MLA: kv_spec.layout), and a scratch block past them where
        CUDA graphs pad (kiln.runner.kv_cache.allocate_kv_caches)."""
        if self.leader is not None:
            self.leader.send(AllocateKV(num_blocks))
        s = self.kv_spec
        log.info("KV cache: %d blocks of %d tokens, %s, %d bytes per token", num_blocks,
                 s.block_size, s.holds.value, s.bytes_per_block // s.block_size)
        self.graphs, self.pool_blocks = None, num_blocks  # graphs hold the old caches
        self.kv_caches = allocate_kv_caches(s, self.kv_layers, num_blocks + self.use_graphs,
                                            self.device)

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
        self.sampling.release(request_ids)

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
        plan = None if plain_greedy(sched.scheduled) else self._plan(sched, batch.rows)
        if plan is not None and self._shortlisted(sched, plan):
            return self._outputs_shortlisted(sched, batch, hidden, plan)
        logits = self.model.compute_logits(hidden[batch.logits_index]).float()
        if plan is None:  # argmax only: no plan, masks or verification
            return RunnerOutput(greedy_tokens(batch.rows, logits, self.vocab_size))
        return self._outputs(sched, batch, logits, plan)

    def _execute_data_parallel(self, sched: SchedulerOutput) -> RunnerOutput:
        """Every rank runs its own requests; rank 0 samples the gathered logits (no draft
        trees: speculative decoding is refused with data-parallel attention)."""
        self.release(sched.finished_ids)
        rows, logits = self.data_parallel.lead(sched, self.leader)
        plan = self._plan(sched, rows)
        sampled, logprobs, _ = self.sampling.sample(sched.scheduled, plan, logits)
        return RunnerOutput(sampled, logprobs, step_prompt_logprobs(sched, rows, logits))

    def _plan(self, sched: SchedulerOutput, rows: list[LogitsRows]) -> SamplePlan:
        """The step's sampling rows, with a fresh grammar bitmask for them."""
        return self.sampling.plan(sched.scheduled, rows, self.grammar_rows(self.vocab_size))

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
        sampled, logprobs, paths = self.sampling.sample(sched.scheduled, plan, logits)
        if any(path for path in paths):
            self._compact(sched, batch, paths)
        return RunnerOutput(sampled, logprobs, step_prompt_logprobs(sched, batch.rows, logits))

    def _compact(self, sched: SchedulerOutput, batch: BatchInputs,
                 paths: list[list[int] | None]) -> None:
        """Draft trees: move the KV of each accepted path to the slots of its positions, in
        every layer (kiln.runner.kv_cache.path_moves), so the cache reads as if the path
        alone had been computed; the scheduler then trims past it. A kept step's hidden rows
        are remapped alike."""
        moves = path_moves(sched.scheduled, batch.layout.query_start.tolist(), paths,
                           self.kv_spec.block_size)
        if not moves.src:
            return
        if self.leader is not None:
            self.leader.send(MoveSlots(moves.src, moves.dst))
        self.move_slots(torch.tensor(moves.src, device=self.device),
                        torch.tensor(moves.dst, device=self.device))
        step = self.last_step
        if step is not None and step.batch is batch:
            rows = torch.arange(len(batch.input_ids), device=self.device)
            rows[torch.tensor(moves.row_dst, device=self.device)] = torch.tensor(
                moves.row_src, device=self.device)
            step.rows = rows

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K and V from slots `src` to `dst` (gathered, then written)."""
        move_kv_slots(self.kv_caches, src, dst, self.platform.kernels is KernelSet.CPP)
