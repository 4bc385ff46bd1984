"""The EAGLE-style head as a proposer: it follows the target step by step, lazily.

The head's KV cache is one layer's worth of K and V over the target's own slots, indexed by
the target's block tables: the head's KV of position p sits in the block where the target
keeps its KV of p, so prefix-cache hits hand over both, and rejected drafts need no rollback.

To fill it, the head must run over every verified position p with the target's features at
p and the token after it. A head forward costs about the same for one position as for a
hundred (its weights dominate), and while adaptive speculation has drafting switched off a
forward per step would be pure overhead. So after each step the proposer only gathers the
target's features of the newly verified positions (one index operation) and keeps them per
request; the head runs over a request's pending positions, as one batch, when the request
next drafts (its last output gives draft 1) or when it finishes (so the blocks it leaves in
the prefix cache carry complete head KV) if the head was drafting for it up to the end (at
most FINISH_CATCH_UP positions pending): a request that was not (adaptive speculation kept
drafting off but for a probe or two) would pay a head forward over most of its text at the end
for nothing but possible later prefix hits, so those positions' head KV is zeroed instead.
Requests that leave without running a step (an abort between steps) drop their pending
positions: their blocks may already be reused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kiln.engine.scheduler import ScheduledRequest, SchedulerOutput
from kiln.models.layers.attention import SeqLayout
from kiln.models.layers.rotary import RotaryEmbedding
from kiln.models.loader import weight_files
from kiln.platform import KernelSet
from kiln.runner.fused_stack import stack_attention_args
from kiln.speculative.head.kv import DraftRows, HeadKV
from kiln.speculative.head.model import (
    FeatureTap,
    lm_head_rows,
    load_head,
    pack_for_inference,
    packed_linear,
    stack_weights,
)
from kiln.speculative.proposer import Draft, DraftRequest, ProposerContext, register_proposer
from kiln.speculative.shortlist import Shortlist


def verified_spans(sched: SchedulerOutput) -> list[tuple[int, ScheduledRequest, int]]:
    """(batch index, scheduled request, n) for each request whose first n computed positions
    of this step are verified and followed by a known token: the positions the head can
    run over (a step's rejected drafts and its newest token are not among them)."""
    spans = []
    for i, item in enumerate(sched.scheduled):
        known = len(item.prompt_token_ids) + len(item.output_token_ids)
        n = min(len(item.token_ids), known - 1 - item.start_pos)
        if n > 0:
            spans.append((i, item, n))
    return spans


def token_slice(item: ScheduledRequest, start: int, end: int) -> list[int]:
    """Tokens [start, end) of a scheduled request's prompt + output, without copying both."""
    prompt, output, n = item.prompt_token_ids, item.output_token_ids, len(item.prompt_token_ids)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n:end - n]
    return prompt[start:] + output[:end - n]


FINISH_CATCH_UP = 16  # at a request's end, run the head over at most this many positions


@dataclass
class _Pending:
    """A request's verified positions [start, end) that the head has not run over yet."""

    start: int
    item: ScheduledRequest  # where it was last scheduled: live token lists and block table
    step: int  # the round it was last scheduled in
    feats: list[torch.Tensor] = field(default_factory=list)  # [n_i, F] chunks, in order
    end: int = field(init=False)  # start + positions held

    def __post_init__(self):
        self.end = self.start

    def add(self, chunk: torch.Tensor) -> None:
        self.feats.append(chunk)
        self.end += len(chunk)

    def truncate(self, position: int) -> None:
        """Forget features from `position` on (the target recomputes them)."""
        kept, at = [], self.start
        for chunk in self.feats:
            if at >= position:
                break
            kept.append(chunk[:position - at])
            at += len(chunk)
        self.feats = kept
        self.end = self.start + sum(len(f) for f in kept)


def whole_vocab_tables(model_path: str, dtype: torch.dtype, device: torch.device,
                       ids: torch.Tensor) -> tuple[nn.Embedding, torch.Tensor]:
    """A tensor-parallel target's whole token embedding and its LM head rows `ids` ([Vd, H]; the
    embedding's when tied), read from its checkpoint: rank 0's model holds only its share of
    the vocabulary, and its embedding's lookup is a collective the other ranks do not join."""
    names = ("model.embed_tokens.weight", "lm_head.weight")
    found: dict[str, torch.Tensor] = {}
    for file in weight_files(Path(model_path)):
        with safe_open(str(file), framework="pt") as f:
            found.update({n: f.get_tensor(n) for n in names if n in f.keys()})
    if names[0] not in found:
        raise ValueError(f"{model_path}: no {names[0]} for the EAGLE-style head's embedding")
    embed = found[names[0]].to(device=device, dtype=dtype)
    lm = found.get(names[1], embed).to(device=device, dtype=dtype)
    return nn.Embedding.from_pretrained(embed, freeze=True), lm[ids].contiguous()


@register_proposer("head")
class HeadProposer:
    def __init__(self, config, ctx: ProposerContext):
        runner = ctx.target
        model, arch = runner.model, runner.model.arch
        # built on the CPU, then every tensor on the target's device, in its platform's formats
        self.head = pack_for_inference(load_head(config.model, runner.dtype), runner.ops,
                                       int8=config.speculator_int8, platform=runner.platform)
        self.ops = runner.ops
        c = self.head.c
        if (c.hidden_size, c.vocab_size) != (arch.hidden_size, arch.vocab_size):
            raise ValueError(f"head {config.model} was trained for a model with hidden "
                             f"size {c.hidden_size} and vocabulary {c.vocab_size}; the "
                             f"target has {arch.hidden_size} and {arch.vocab_size}")
        self.target, self.block_size, self.device = runner, ctx.cache.block_size, runner.device
        self.min_prob, self.tree_size = config.tree_min_prob or None, config.tree_size
        sharded = ctx.parallel.tensor_parallel_size > 1
        self.embed, rows = (whole_vocab_tables(ctx.model_path, runner.dtype, runner.device,
                                               self.head.draft_vocab) if sharded else
                            (model.model.embed_tokens, lm_head_rows(model, self.head.draft_vocab)))
        self.lm = packed_linear(rows, config.speculator_int8, runner.platform)
        # the same rows guess the target's choices in verification (in one process: the
        # shortlist's LM head rows would skip a tensor-parallel step's logits gather)
        if config.verify_shortlist and not sharded:
            runner.shortlist = Shortlist(self.head.draft_vocab, self.lm)
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta,
                                      c.rope_scaling, runner.dtype).to(runner.device)
        self.tap = FeatureTap(model, c.feature_layers)
        self.paged, self.scale = runner.backend, c.head_dim ** -0.5  # the target's kernels
        self.cache = HeadKV(runner.kv_caches[0][0].shape[0], c.num_kv_heads, c.head_dim,
                            runner.dtype, self.block_size, runner.device)
        self.kernels = runner.platform.kernels is KernelSet.CPP
        # the layer in one C++ call (as the target's own layers), where it is packed for it:
        # per weight set, (most rows, its tensor arguments, plain bf16)
        sets = stack_weights(self.head) if runner.platform.fused_stack else None
        self.stack = None if sets is None else [
            (rows, self._stack_tensors(w), plain) for rows, w, plain in sets]
        self.stack_long = (self.stack is not None and self.paged.bf16_prefill
                           and c.head_dim in (64, 128) and runner.dtype == torch.bfloat16)
        self.pending: dict[str, _Pending] = {}
        self.drafted: set[str] = set()  # requests the head has drafted for
        self.rounds = 0
        runner.keep_hidden = True

    @property
    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.kv

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, wanted: list[DraftRequest]) -> list[Draft]:
        self.rounds += 1
        step = self.target.last_step
        if step is not None and not sched.empty:
            self._collect(sched, step)
        if not wanted:
            return []
        self.drafted.update(w.request.request_id for w in wanted)
        return self._draft(wanted, self._run([w.request.request_id for w in wanted]))

    @torch.inference_mode()
    def release(self, request_ids: list[str]) -> None:
        due = [rid for rid in request_ids
               if rid in self.pending and self.pending[rid].step == self.rounds]
        # blocks freed this step are not reused before the next schedule: complete the head
        # KV they leave in the prefix cache where the head was drafting for the request up to
        # its end; where it was not (drafting switched off, a probe long ago), catching up
        # would be a head forward over most of the text for nothing but possible later prefix
        # hits, so those positions' head KV is zeroed instead (a prefix hit attends nothing
        # there)
        current = [rid for rid in due if rid in self.drafted
                   and self.pending[rid].end - self.pending[rid].start <= FINISH_CATCH_UP]
        self._run(current)
        self._forget([rid for rid in due if rid not in current])
        for rid in request_ids:
            self.pending.pop(rid, None)
            self.drafted.discard(rid)

    def _forget(self, request_ids: list[str]) -> None:
        """Zero the head KV of these requests' pending positions."""
        slots = []
        for rid in request_ids:
            p = self.pending.pop(rid)
            pos = torch.arange(p.start, p.end, device=self.device)
            blocks = torch.tensor(p.item.block_ids, device=self.device)[pos // self.block_size]
            slots.append(blocks * self.block_size + pos % self.block_size)
        if slots:
            index = torch.cat(slots)
            self.kv[0][index] = 0
            self.kv[1][index] = 0

    # -- catching up ----------------------------------------------------------------------

    def _collect(self, sched: SchedulerOutput, step) -> None:
        """Keep the target's features of each request's newly verified positions."""
        spans = verified_spans(sched)
        if not spans:
            return
        starts = step.batch.layout.query_start
        if all(n == 1 for _, _, n in spans):  # decode steps: one position per request
            flat = starts[torch.tensor([i for i, _, _ in spans], device=starts.device)]
            chunks = self.tap.features(step.hidden, step.physical(flat))[:, None].unbind()
        else:
            flat = torch.cat([torch.arange(n, device=starts.device) + int(starts[i])
                              for i, _, n in spans])
            chunks = self.tap.features(step.hidden, step.physical(flat)).split(
                [n for _, _, n in spans])
        for (_, item, _), chunk in zip(spans, chunks, strict=True):
            p = self.pending.get(item.request_id)
            if p is None or not p.start <= item.start_pos <= p.end:
                p = self.pending[item.request_id] = _Pending(item.start_pos, item, self.rounds)
            elif item.start_pos < p.end:  # recomputed after a preemption
                p.truncate(item.start_pos)
            p.add(chunk)
            p.item, p.step = item, self.rounds

    def _run(self, request_ids: list[str]) -> dict:
        """Run the head over these requests' pending positions, as one batch; returns per
        request its last output h, that h's final norm, its context length and its
        block-table row."""
        entries = [(rid, self.pending.pop(rid)) for rid in request_ids if rid in self.pending]
        entries = [(rid, p) for rid, p in entries if p.feats]
        if not entries:
            return {}
        device = self.device
        lens = torch.tensor([p.end - p.start for _, p in entries], device=device)
        positions = torch.cat([torch.arange(p.start, p.end, device=device) for _, p in entries])
        after = [t for _, p in entries  # the token after each position
                 for t in token_slice(p.item, p.start + 1, p.end + 1)]
        tokens = torch.tensor(after, device=device)
        width = max(len(p.item.block_ids) for _, p in entries)
        tables = [p.item.block_ids + [0] * (width - len(p.item.block_ids)) for _, p in entries]
        rows = torch.tensor(tables, device=device)
        layout = SeqLayout(torch.cumsum(lens, 0) - lens, lens,
                           torch.tensor([p.start for _, p in entries], device=device), rows)
        meta = self.paged.build_metadata(layout, positions, self.block_size)
        g = self.head.features(torch.cat([f for _, p in entries for f in p.feats]))
        h, normed = self._forward(g, tokens, positions, meta)
        ends = (torch.cumsum(lens, 0) - 1).tolist()
        return {rid: (h[end], normed[end], p.end, row)
                for (rid, p), end, row in zip(entries, ends, rows, strict=True)}

    # -- drafting -------------------------------------------------------------------------

    def _draft(self, wanted: list[DraftRequest], last: dict) -> list[Draft]:
        live = [i for i, w in enumerate(wanted) if w.request.request_id in last]
        out = [Draft() for _ in wanted]
        if not live:
            return out
        rows = [last[wanted[i].request.request_id] for i in live]
        h = torch.stack([r[0] for r in rows])
        normed = torch.stack([r[1] for r in rows])
        ctx_len = torch.tensor([r[2] for r in rows], device=self.device)
        tables = torch.stack([r[3] for r in rows])
        k = max(wanted[i].max_drafts for i in live)
        width = max(wanted[i].tree_width for i in live)
        if width > 1:
            for i, tree in zip(live, self._tree(h, normed, ctx_len, tables, k, width), strict=True):
                out[i] = tree
            return out
        token = self._pick(normed)
        drafts = [token]
        if k > 1:
            rows = self._rows(ctx_len, tables, 1, 1, k - 1)
            for j in range(k - 1):
                h, normed = self._step(rows, h, token, j)
                token = self._pick(normed)
                drafts.append(token)
        table = torch.stack(drafts, dim=1).tolist()
        for b, i in enumerate(live):
            out[i] = Draft(table[b][:wanted[i].max_drafts])
        return out

    def _tree(self, h, normed, ctx_len, tables, depth: int, width: int) -> list[Draft]:
        return [_best_nodes(n, tree_node_count(n, depth * width, self.min_prob, self.tree_size))
                for n in self._tree_nodes(h, normed, ctx_len, tables, depth, width)]

    def _tree_nodes(self, h, normed, ctx_len, tables, depth: int,
                    width: int) -> list[list[tuple]]:
        """EAGLE-2's dynamic draft tree, per sequence: a beam search `width` rows wide over
        `depth` draft steps (each step expands the `width` likeliest paths so far by their
        `width` likeliest next tokens), then the depth * width likeliest of all expanded
        nodes, a path's likelihood being the product of the head's probabilities along it.
        The tree grows where the head is sure and branches where it is not: the nodes kept
        are the ones most likely to be accepted, whatever their depth.

        With a floor (min_prob) a beam whose path probability is below it is not expanded:
        no node under it can reach the floor (a node is never likelier than its parent), so
        the rule keeps the same nodes, and the head runs on fewer rows (an 8-wide beam at
        P >= 0.012 on prose: about 4 of 8 rows at the second draft step, 5 at the third;
        at 4 rows or fewer its int8 weights serve, so its probabilities move slightly)."""
        b = len(h)
        logp, token = self._top(normed, width)  # [B, W]: the first drafts
        # per sequence: nodes (log-likelihood, depth, token, parent), the beams' node ids
        logps = logp.tolist()
        nodes = [[(s, 1, t, -1) for s, t in zip(ls, ts, strict=True)]
                 for ls, ts in zip(logps, token.tolist(), strict=True)]
        live = self._live(logps, width)  # beams expanded: the likeliest, the same per sequence
        if depth == 1 or live == 0:
            return nodes
        beams = [list(range(live)) for _ in range(b)]
        rows = self._rows(ctx_len, tables, live, width, depth - 1)
        h = h.repeat_interleave(live, 0)
        score, fed = logp[:, :live], token[:, :live].reshape(-1)
        for d in range(2, depth + 1):
            h, normed = self._step(rows, h, fed, d - 2)
            child_logp, child = self._top(normed, width)  # [B * live, W]
            cand = (score.reshape(-1, 1) + child_logp).view(b, live * width)
            child = child.view(b, live * width)
            first = [len(n) for n in nodes]  # node id of each sequence's first candidate
            cands = cand.tolist()
            for s, (ls, ts) in enumerate(zip(cands, child.tolist(), strict=True)):
                nodes[s] += [(ls[c], d, ts[c], beams[s][c // width])
                             for c in range(live * width)]
            if d == depth:
                break
            next_live = self._live(cands, width)
            if next_live == 0:
                break
            score, best = cand.topk(next_live, dim=-1)  # the next beams, likeliest first
            kept = (torch.arange(b, device=best.device)[:, None] * live + best // width).reshape(-1)
            h = h[kept]
            rows.reorder(kept)
            fed = child.gather(1, best).reshape(-1)
            beams = [[first[s] + c for c in row] for s, row in enumerate(best.tolist())]
            live = next_live
        return nodes

    def _live(self, logps: list[list[float]], width: int) -> int:
        """How many beams to expand, of each sequence's `width` likeliest paths (candidates'
        log-likelihoods per sequence): those at or above the floor in the sequence that has
        the most, all `width` without one."""
        if self.min_prob is None:
            return width
        floor = math.log(self.min_prob)
        return min(width, max(sum(lp >= floor for lp in row) for row in logps))

    # -- the head's layer ------------------------------------------------------------------

    def _rows(self, ctx_len: torch.Tensor, tables: torch.Tensor, rows_per_seq: int,
              width: int, steps: int) -> DraftRows:
        return DraftRows(self.cache, ctx_len, tables, rows_per_seq, width, steps, self.kernels)

    def _step(self, rows: DraftRows, h: torch.Tensor, tokens: torch.Tensor,
              step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft step `step` of a round for every row: -> (h, its final norm)."""
        layout, positions, slots = rows.layout(step)
        meta = self.paged.build_metadata(layout, positions, self.block_size, slots)
        return self._forward(h, tokens, positions, meta)

    def _forward(self, g: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The head at these positions (g: target features or the head's own h; tokens: the
        token after each position), attending the head's cache through `meta` -> (h, the
        next feature estimate [T, H]; its final norm, which the LM rows read).

        Where the layer is packed for it, one call to `kiln::llama_stack` runs it (norms,
        q/k/v, rotary, KV write, attention, o, MLP and the final norm: the target's own
        kernels), which x, the residual stream, leaves as h; otherwise the layer's ops one by
        one (rotary from the bf16 tables rather than fp32 ones, so not the same bits)."""
        head = self.head
        x = head.fc(torch.cat((self.embed(tokens), g.to(self.embed.weight.dtype)), dim=-1))
        weights = self._stack_set(len(x), meta)
        if weights is None:
            cos, sin = self.rotary.cos[positions][:, None], self.rotary.sin[positions][:, None]
            h = head.layer(x, cos, sin,
                           lambda q, k, v: self.paged.forward(q, k, v, self.kv, meta, self.scale))
            return h, self.ops.rms_norm(h, head.norm, head.c.rms_norm_eps)
        _, tensors, plain = weights
        c, (k_cache, v_cache) = head.c, self.kv
        normed = torch.ops.kiln.llama_stack(
            x, positions, *tensors, [k_cache], [v_cache], *stack_attention_args(meta),
            self.scale, c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, plain)
        return x, normed

    def _stack_tensors(self, w: dict) -> tuple:
        """`kiln::llama_stack`'s arguments from input_norm to sin32 for one weight set (no
        q/k norms; a dense MLP, so no router)."""
        layer = self.head.layer
        scales = [[w[name][1]] if w[name][1].numel() else [] for name in w]
        return ([layer.input_layernorm], [w["qkv"][0]], [w["o"][0]],
                [layer.post_attention_layernorm], [w["gate_up"][0]], [w["down"][0]], *scales,
                [], [], [None], [None], 0, False,
                self.head.norm, self.rotary.cos32, self.rotary.sin32)

    def _stack_set(self, rows: int, meta) -> tuple | None:
        """The layer's tensors for `kiln::llama_stack` at this many rows, or None (the ops
        one by one)."""
        if self.stack is None or (meta.long is not None and not self.stack_long):
            return None
        return next((entry for entry in self.stack if rows <= entry[0]), None)

    def _pick(self, normed: torch.Tensor) -> torch.Tensor:
        """The head's choice per row ([B]), from its final norm."""
        return self.head.draft_vocab[self.lm(normed).argmax(dim=-1)]

    def _top(self, normed: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's `width` likeliest tokens per row (from its final norm), best first, with
        their log-probabilities (over the draft vocabulary): ([B, width] float32, [B, width]
        target ids)."""
        logits = self.lm(normed)
        if self.kernels:  # one C++ call (among equal logits the lower index first)
            return torch.ops.kiln.top_logprobs(logits, width, self.head.draft_vocab)
        logp, index = logits.float().log_softmax(dim=-1).topk(width, dim=-1)
        return logp, self.head.draft_vocab[index]


def tree_node_count(nodes: list[tuple[float, int, int, int]], likeliest: int,
                    min_prob: float | None, size: int) -> int:
    """How many of a beam's nodes (log-likelihood, depth, token, parent) its tree keeps: the
    `likeliest` without a floor; with one, those whose path probability reaches `min_prob`,
    at least one and at most `size` (a node is never likelier than its parent, so the kept
    nodes are a tree)."""
    if min_prob is None:
        return likeliest
    floor = math.log(min_prob)
    return max(1, min(size, sum(1 for lp, *_ in nodes if lp >= floor)))


def _best_nodes(nodes: list[tuple[float, int, int, int]], size: int) -> Draft:
    """The `size` likeliest of a tree's nodes (log-likelihood, depth, token, parent), as a
    Draft: likeliest first, so every node comes after its parent (never likelier than it;
    on a tie the shallower first) and each node's first child is its likeliest."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][1], i))[:size]
    index = {-1: -1}
    for i in order:
        index[i] = len(index) - 1
    return Draft([nodes[i][2] for i in order], None, [index[nodes[i][3]] for i in order])
