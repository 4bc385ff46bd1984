"""Draft-model proposer: a smaller checkpoint sharing the target's tokenizer guesses greedily.

The draft model runs in kiln's own machinery: a `ModelRunner` (its weights, its paged KV
tensors, greedy sampling) and a `KVCacheManager` over its own block pool, with prefix caching.
Each target request has a shadow `Request` on the draft side whose `all_token_ids` are the
target's verified tokens only; this round's drafts ride beyond them as extra tokens, as they
do on the target side, so the draft's prefix cache never publishes an unverified block.

One round for the requests that want drafts, batched:
  1. sync: keep the draft KV of the longest prefix that the target verified (the verified
     tokens plus the drafts it accepted), trim the rest, append the new verified tokens;
  2. catch up: compute every verified token the draft has not seen; the last one's greedy
     choice is draft 1;
  3. k - 1 single-token steps: draft j from draft j - 1.
Greedy choices come from the whole vocabulary, or, when the checkpoint carries a draft
vocabulary (`draft_vocab` in its speculator.json, written by `kiln train-speculator --kind
draft`: the target's most frequent choices in the training data), from those rows of the LM
head only: for a small model the LM head is most of the weights read per step.
A request whose draft KV cannot be allocated gets no drafts this round (and loses its draft
cache state); when adaptive speculation pauses drafting, shadows simply lag and catch up later.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kiln.config import ParallelConfig
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.request import Request
from kiln.engine.scheduler import ScheduledRequest, SchedulerOutput
from kiln.sampling_params import SamplingParams
from kiln.speculative.proposer import Draft, DraftRequest, ProposerContext, register_proposer

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclasses.dataclass
class _Shadow:
    request: Request  # verified tokens only; num_computed_tokens = positions with draft KV
    drafted: list[int] = dataclasses.field(default_factory=list)  # computed beyond verified


def _draft_parallel(ctx: ProposerContext) -> ParallelConfig:
    """A tensor-parallel target's draft runs in rank 0's process alone, at its threads (torch's
    count is per process): a draft model is small, and its drafts are tokens, which every
    rank's verify step takes (docs/parallelism.md)."""
    if ctx.parallel.tensor_parallel_size == 1:
        return ctx.parallel
    return ParallelConfig(num_threads=torch.get_num_threads())


@register_proposer("draft")
class DraftModelProposer:
    def __init__(self, config, ctx: ProposerContext):
        from kiln.runner.model_runner import ModelRunner
        from kiln.speculative.head.model import int8_gemv_available

        # int8 weight-only (kiln's int8 GEMV at decode sizes: C++ on a CPU, Triton on a GPU)
        # where the platform has one: a small model's weights come from memory at every draft
        # step, half the bytes cut a draft round's time by a quarter or more on a CPU (a
        # quantized checkpoint keeps its own formats)
        self.platform = ctx.target.platform  # the draft's config differs in its model only
        self.int8 = config.speculator_int8 and int8_gemv_available(self.platform)
        model_config = dataclasses.replace(ctx.model, model=config.model,
                                           quantization="int8" if self.int8 else None)
        # the draft's weights and KV on the target's device (its runner's platform)
        self.runner = ModelRunner(model_config, config.model, ctx.cache, _draft_parallel(ctx),
                                  ctx.eos_token_ids)
        if self.runner.vocab_size != ctx.target.vocab_size:
            raise ValueError(f"draft model {config.model} has a vocabulary of "
                             f"{self.runner.vocab_size}, the target {ctx.target.vocab_size}: "
                             f"a draft model must share the target's tokenizer")
        num_blocks = self._pool_blocks(config, ctx)
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(ctx.cache, num_blocks)
        self.shadows: dict[str, _Shadow] = {}
        self._finished: list[str] = []
        self.vocab, self.lm = self._draft_vocab(Path(config.model))
        # (the shortlist reads the target's whole LM head: one process only)
        if (self.vocab is not None and config.verify_shortlist
                and ctx.parallel.tensor_parallel_size == 1):
            from kiln.speculative.head.model import lm_head_rows, packed_linear
            from kiln.speculative.shortlist import Shortlist

            # the target's LM head rows for the draft vocabulary guess its choices in
            # verification (kiln.speculative.shortlist)
            ctx.target.shortlist = Shortlist(self.vocab, packed_linear(
                lm_head_rows(ctx.target.model, self.vocab), platform=self.platform))

    def _pool_blocks(self, config, ctx: ProposerContext) -> int:
        """The draft's KV blocks: `draft_kv_cache_memory` bytes when given; on a GPU as many
        tokens as the target's pool holds (the draft mirrors its sequences), fewer where the
        memory the target left does not hold them (kiln.runner.device_memory.draft_kv_blocks);
        on the CPU max_model_len x max_num_seqs tokens, capped (the target's CPU rule)."""
        from kiln.runner.device_memory import draft_kv_blocks
        from kiln.runner.kv_cache import num_kv_blocks

        spec, sc = self.runner.kv_spec, ctx.scheduler
        cache = dataclasses.replace(ctx.cache, kv_cache_memory=config.draft_kv_cache_memory)
        memory = self.runner.device_memory(sc.max_num_batched_tokens, sc.max_num_seqs)
        if cache.kv_cache_memory is not None or memory is None:
            return num_kv_blocks(spec, cache, ctx.max_model_len, sc.max_num_seqs)
        wanted = min(ctx.target.pool_blocks, -(-ctx.max_model_len // spec.block_size)
                     * sc.max_num_seqs)
        return draft_kv_blocks(memory, wanted, spec.bytes_per_block)

    def _draft_vocab(self, path: Path):
        """(token ids, their LM head rows packed) when the checkpoint carries a draft
        vocabulary (`kiln train-speculator --kind draft` writes one), else (None, None)."""
        import json

        from kiln.speculative.head.model import lm_head_rows, packed_linear
        from kiln.speculative.resolve import SPECULATOR_FILE

        meta = path / SPECULATOR_FILE
        ids = json.loads(meta.read_text()).get("draft_vocab") if meta.is_file() else None
        if ids is None:
            return None, None
        n = self.runner.vocab_size
        if (not isinstance(ids, list) or not ids
                or not all(type(i) is int and 0 <= i < n for i in ids)):
            raise ValueError(f"{meta}: draft_vocab must be a non-empty list of token ids "
                             f"below {n}")
        ids = torch.tensor(ids, device=self.runner.device)
        return ids, packed_linear(lm_head_rows(self.runner.model, ids), self.int8, self.platform)

    def propose(self, sched: SchedulerOutput, wanted: list[DraftRequest]) -> list[Draft]:
        live = {}  # index in wanted -> shadow
        for i, w in enumerate(wanted):
            shadow = self._sync(w.request)
            if shadow is not None:
                live[i] = shadow
        drafts: dict[int, list[int]] = {i: [] for i in live}
        tokens = {i: s.request.all_token_ids[s.request.num_computed_tokens:]
                  for i, s in live.items()}
        for _ in range(max((wanted[i].max_drafts for i in live), default=0)):
            tokens = self._step(live, tokens)
            for i, token in tokens.items():
                drafts[i].append(token[0])
            tokens = {i: t for i, t in tokens.items() if len(drafts[i]) < wanted[i].max_drafts}
        for i, shadow in live.items():
            shadow.drafted = drafts[i][:-1]  # the last draft was chosen, never computed
        return [Draft(drafts.get(i, [])) for i in range(len(wanted))]

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            shadow = self.shadows.pop(rid, None)
            if shadow is not None:
                self.kv.free(shadow.request)
                self._finished.append(rid)

    # -- internals ------------------------------------------------------------------------

    def _sync(self, target: Request) -> _Shadow | None:
        """The request's shadow with draft KV trimmed to what the target verified."""
        shadow = self.shadows.get(target.request_id)
        if shadow is None:
            return self._admit(target)
        req, verified = shadow.request, target.all_token_ids
        known = req.num_tokens
        agree = 0
        while (agree < len(shadow.drafted) and known + agree < len(verified)
               and shadow.drafted[agree] == verified[known + agree]):
            agree += 1
        req.num_computed_tokens = min(req.num_computed_tokens, known + agree)
        self.kv.trim(req, req.num_computed_tokens)
        for token in verified[known:]:
            req.append_output_token(token)
        shadow.drafted = []
        return shadow

    def _admit(self, target: Request) -> _Shadow | None:
        req = Request(target.request_id, target.all_token_ids, GREEDY)
        cached = self.kv.find_cached_prefix(req)
        if not self.kv.allocate(req, 0, cached):
            return None
        req.num_computed_tokens = len(cached) * self.kv.block_size
        shadow = self.shadows[target.request_id] = _Shadow(req)
        return shadow

    def _step(self, live: dict[int, _Shadow], tokens: dict[int, list[int]]
              ) -> dict[int, list[int]]:
        """Compute `tokens` for each listed shadow; returns each one's greedy next token."""
        items, owners = [], []
        for i, new in tokens.items():
            req = live[i].request
            if not self.kv.allocate(req, len(new)):
                self.release([req.request_id])
                continue
            items.append(ScheduledRequest(
                request_id=req.request_id, token_ids=new, start_pos=req.num_computed_tokens,
                num_draft_tokens=0, block_ids=self.kv.block_ids(req.request_id), samples=True,
                params=GREEDY, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids, prompt_logprobs=False))
            owners.append(i)
        if not items:
            return {}
        finished, self._finished = self._finished, []
        sched = SchedulerOutput(items, sum(len(t.token_ids) for t in items), finished)
        sampled = (self.runner.execute(sched).sampled_token_ids if self.lm is None
                   else self._greedy_in_vocab(sched))
        for i, item in zip(owners, items, strict=True):
            live[i].request.num_computed_tokens += len(item.token_ids)
        return {i: tokens for i, tokens in zip(owners, sampled, strict=True)}

    @torch.inference_mode()
    def _greedy_in_vocab(self, sched: SchedulerOutput) -> list[list[int]]:
        """The runner's step, with the greedy choice over the draft vocabulary only: the LM
        head is most of a small model's weights, and the target's choices come from a few
        thousand tokens."""
        batch, hidden = self.runner.forward(sched)
        best = self.vocab[self.lm(hidden[batch.logits_index]).argmax(dim=-1)]
        return [[t] for t in best.tolist()]
