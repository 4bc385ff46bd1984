"""Training speculators on the target's own view of a corpus (kiln.speculative.training.data.TargetRecord).

Head (`HeadTrainer`): the EAGLE-style head learns to predict the target's greedy choice two
tokens ahead from the target's features, unrolled the way it is used ("training-time test",
EAGLE-3): step 1 reads the target's features at every position p with token t_{p+1}; step j
reads the head's own output of step j - 1 with token t_{p+j}, at position p + j - 1, and
attends to step-1 keys at positions <= p plus its own round's keys of steps 2..j (exactly
the draft rows' attention at inference, kiln.speculative.head.kv.DraftRows). At inference the head
only ever continues the target's own greedy choices, so (by default) it learns only at
positions where every token it is given equals the target's greedy choice before it
("greedy-consistent" positions): raw text then looks like the target's own output locally,
and agreement there estimates acceptance.
A curriculum trains step 1 alone for the first `first_step_share` of the optimizer steps (a
third of the cost, and it learns fastest), then all steps together. Loss per step j
(weighted 0.8^(j-1)): cross-entropy against the target's greedy tokens over the draft
vocabulary (the most frequent target choices in the data), or with `soft_labels` against
its whole distribution there (recomputed from the recorded final hidden state); and, when
the head reads that state, a little of EAGLE-1's feature regression (`regression_weight`).
Neither soft labels nor dropping the regression moved a prose head's agreement
(docs/decisions/0010). Forward passes run in bf16 autocast where the CPU has bf16 arithmetic
(fp32 elsewhere), and a share of the sequences is held out to report agreement on text the
head did not train on: other windows of the same documents, so it reads higher than on
documents never seen (benchmarks/experiments/head_agreement.py measures those: the benchmark's
prompts).

Draft model (`distill_draft`): a Llama with the target's embedding, first n layers and final
norm (an early-exit model), trained by cross-entropy against the target's greedy tokens, then
saved as a plain HF checkpoint with the target's tokenizer: any engine can load it.
"""

from __future__ import annotations

import functools
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.speculative.head.model import FINAL, EagleHead, HeadConfig, lm_head_rows, rms_norm
from kiln.speculative.training.data import TargetRecord

IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 3
    batch_size: int = 8  # sequences per optimizer step
    lr: float = 3e-3
    warmup: float = 0.05  # share of steps with a linear warmup, then cosine decay
    ttt_steps: int = 3  # head: unrolled draft steps per position (match k at inference)
    first_step_share: float = 0.6  # head: share of optimizer steps that train step 1 only
    draft_vocab_size: int = 4096  # head: most frequent target tokens it may propose (0 = all)
    feature_layers: tuple[int, ...] = (FINAL,)  # head: target features it reads
    intermediate_size: int | None = None  # head MLP width; None = the target's
    draft_layers: int = 2  # draft model: target layers it starts from (the first n)
    regression_weight: float = 0.1  # head: weight of the feature-regression loss
    soft_labels: bool = False  # head: match the target's distribution, not just its argmax
    consistent_only: bool = True  # head: learn only where inputs follow the target's choices
    eval_fraction: float = 0.1  # sequences held out for evaluation
    # bf16 autocast for forward passes (fp32 master weights); None: where the CPU has bf16
    # arithmetic (oneDNN prepacks bf16), else fp32 — emulated bf16 matmuls run several times
    # slower than fp32 ones (see docs/decisions/0003)
    autocast: bool | None = None
    seed: int = 0


@dataclass
class History:
    loss: list[float] = field(default_factory=list)  # per optimizer step
    accuracy: list[list[float]] = field(default_factory=list)  # per step: per unrolled step
    eval_accuracy: list[float] = field(default_factory=list)  # held out, per unrolled step


ProgressFn = Callable[[int, History], None]  # (optimizer step, history so far)


def bf16_autocast(cfg: TrainConfig) -> torch.autocast:
    """The forward passes' autocast context: bf16 as `cfg.autocast` says (None: where the
    CPU has bf16 arithmetic)."""
    enabled = _native_bf16() if cfg.autocast is None else cfg.autocast
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


@functools.cache
def _native_bf16() -> bool:
    from kiln.kernels.bf16_mm import onednn_available

    return onednn_available(torch.bfloat16)


def choose_draft_vocab(labels: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target tokens chosen most often in the data (ties: lower id), sorted."""
    counts = torch.bincount(labels.reshape(-1), minlength=vocab_size).float()
    counts -= torch.arange(vocab_size) * 1e-9  # stable tie-break
    size = vocab_size if size <= 0 else min(size, vocab_size)
    return counts.topk(size).indices.sort().values


class TrainChain:
    """Training-time attention for the unrolled head over [b, L] round starts: step 1 is
    causal; step j attends step-1 keys at positions <= p plus steps 2..j's keys at p."""

    def __init__(self, b: int, length: int, c: HeadConfig):
        self.b, self.length, self.c = b, length, c
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q, k, v) -> torch.Tensor:
        b, n, c = self.b, self.length, self.c
        q = q.view(b, n, c.num_heads, c.head_dim).transpose(1, 2)  # [b, Hq, L, D]
        rep = c.num_heads // c.num_kv_heads
        k = k.view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2).repeat_interleave(rep, 1)
        v = v.view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2).repeat_interleave(rep, 1)
        self.keys.append(k)
        self.values.append(v)
        scale = c.head_dim ** -0.5
        if len(self.keys) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            ctx = (q @ self.keys[0].transpose(-1, -2)) * scale  # [b, Hq, L, L]
            ctx = ctx.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            diag = [(q * km).sum(-1, keepdim=True) * scale for km in self.keys[1:]]
            weights = torch.cat([ctx, *diag], dim=-1).softmax(dim=-1)
            out = weights[..., :n] @ self.values[0]
            for m, vm in enumerate(self.values[1:]):
                out = out + weights[..., n + m:n + m + 1] * vm
        return out.transpose(1, 2).reshape(b * n, c.num_heads * c.head_dim)


def unroll(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor, steps: int,
           embed: torch.Tensor, lm_rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The head unrolled over `steps` draft steps at every position p < S - steps of [b, S]
    sequences (`feats` [b, S, F] the target's features), as it drafts at inference: step j
    reads token t_{p+j} and the previous step's output (step 1: the target's features at p).
    Yields (h [b * n, H], draft-vocabulary logits [b * n, Vd]) per step; step j's logits
    guess t_{p+j+1}."""
    b, seq = tokens.shape
    n = seq - steps
    chain = TrainChain(b, n, head.c)
    g = head.features(feats[:, :n].reshape(b * n, -1).float())
    for j in range(1, steps + 1):
        pos = (torch.arange(n) + j - 1).repeat(b)
        emb = F.embedding(tokens[:, j:j + n].reshape(-1), embed)
        g = head(g, emb, cos[pos][:, None], sin[pos][:, None], chain)
        yield g, head.logits(g, lm_rows)


class HeadTrainer:
    """`init`: a trained head for the same target to go on training (more epochs, or other
    data) — its shape, features and draft vocabulary are kept, and since its first draft
    step is trained already, every optimizer step trains all the unrolled steps."""

    def __init__(self, model, record: TargetRecord, cfg: TrainConfig, target_name: str = "",
                 init: EagleHead | None = None):
        from kiln.models.layers.rotary import RotaryEmbedding

        torch.manual_seed(cfg.seed)
        arch = model.arch
        self.cfg, self.record = cfg, record
        self.train_idx, self.eval_idx = split_sequences(len(record.tokens), cfg)
        if init is not None:
            check_init(init.c, arch, cfg)
            self.head = EagleHead(init.c, init.draft_vocab).float().train()
            self.head.load_state_dict(init.state_dict())  # copied into fp32
            self.first_only_share = 0.0
        else:
            vocab = choose_draft_vocab(record.labels[self.train_idx], cfg.draft_vocab_size,
                                       arch.vocab_size)
            config = HeadConfig.for_target(arch, len(vocab), cfg.feature_layers, target_name,
                                           cfg.intermediate_size)
            self.head = EagleHead(config, vocab).float().train()
            _init_head(self.head, model)
            self.first_only_share = cfg.first_step_share
        vocab, config = self.head.draft_vocab, self.head.c
        self.embed = model.model.embed_tokens.weight.detach().float()
        self.lm_rows = lm_head_rows(model, vocab).detach().float()
        self.to_draft = torch.full((arch.vocab_size,), IGNORE, dtype=torch.int64)
        self.to_draft[vocab] = torch.arange(len(vocab))
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling, torch.float32)
        self.cos, self.sin = rotary.cos, rotary.sin
        h = arch.hidden_size
        final = cfg.feature_layers.index(FINAL) if FINAL in cfg.feature_layers else None
        self.final = None if final is None else slice(final * h, (final + 1) * h)

    def loss(self, idx: torch.Tensor, steps: int | None = None
             ) -> tuple[torch.Tensor, list[float]]:
        """Loss and per-step agreement with the target on the sequences `idx`, unrolled
        over `steps` draft steps (default: ttt_steps)."""
        with bf16_autocast(self.cfg):
            return self._unrolled_loss(idx, steps or self.cfg.ttt_steps)

    def _unrolled_loss(self, idx: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float]]:
        tokens, labels, feats = (self.record.tokens[idx], self.record.labels[idx],
                                 self.record.features[idx])
        b, seq = tokens.shape
        n = seq - steps
        total, accuracy = torch.zeros(()), []
        keep = torch.ones(b * n, dtype=torch.bool)
        unrolled = unroll(self.head, feats, tokens, steps, self.embed, self.lm_rows, self.cos,
                          self.sin)
        for j, (h, logits) in enumerate(unrolled, start=1):
            logits = logits.float()
            want = labels[:, j:j + n].reshape(-1)
            if self.cfg.consistent_only:  # the input token is what the target chose there
                keep = keep & (labels[:, j - 1:j - 1 + n].reshape(-1) == tokens[:, j:j + n]
                               .reshape(-1))
            step_loss = self._step_loss(h, logits, want, keep,
                                        None if self.final is None else
                                        feats[:, j:j + n, self.final].reshape(b * n, -1))
            total = total + 0.8 ** (j - 1) * step_loss
            hit = (self.head.draft_vocab[logits.argmax(-1)] == want)[keep]
            accuracy.append(float(hit.float().mean()) if len(hit) else 0.0)
        return total, accuracy

    def _step_loss(self, h, logits, want, keep, target_feature) -> torch.Tensor:
        if not bool(keep.any()):
            return logits.sum() * 0.0
        h, logits, want = h[keep], logits[keep], want[keep]
        target = None if target_feature is None else target_feature[keep].float()
        if target is not None and self.cfg.soft_labels:  # the target's own distribution
            soft = (target @ self.lm_rows.T).softmax(dim=-1)
            loss = -(soft * logits.log_softmax(dim=-1)).sum(-1).mean()
        else:
            loss = F.cross_entropy(logits, self.to_draft[want], ignore_index=IGNORE)
        if target is not None and self.cfg.regression_weight:
            normed = rms_norm(h.float(), self.head.norm.float(), self.head.c.rms_norm_eps)
            loss = loss + self.cfg.regression_weight * F.smooth_l1_loss(normed, target)
        return loss

    def fit(self, progress: ProgressFn | None = None) -> History:
        params = [p for p in self.head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=0.01)
        history = History()
        total = _num_steps(len(self.train_idx), self.cfg)
        first_only = int(self.first_only_share * total)
        for step, idx in enumerate(_batches(self.train_idx, self.cfg)):
            for group in opt.param_groups:
                group["lr"] = self.cfg.lr * _schedule(step, total, self.cfg)
            loss, accuracy = self.loss(idx, 1 if step < first_only else None)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            history.loss.append(loss.item())
            history.accuracy.append(accuracy)
            if progress is not None:
                progress(step + 1, history)
        self.head.eval()
        history.eval_accuracy = self.evaluate()
        return history

    @torch.no_grad()
    def evaluate(self) -> list[float]:
        """Per-step agreement with the target on the held-out sequences."""
        if not len(self.eval_idx):
            return []
        parts = [self.loss(idx)[1] for idx in self.eval_idx.split(self.cfg.batch_size)]
        return [sum(p[j] for p in parts) / len(parts) for j in range(len(parts[0]))]


def _init_head(head: EagleHead, model) -> None:
    """PyTorch's default init, except the output norm: the target's final norm, so the
    head's logits start on the target's scale. (Starting as "pass the feature through" is
    a trap: the target's feature at p predicts t_{p+1}, the token the head is given, and
    the head learns to echo it.)"""
    with torch.no_grad():
        head.norm.copy_(model.model.norm.weight.detach().float())


def check_init(c: HeadConfig, arch, cfg: TrainConfig) -> None:
    """A head to go on training must be one for this target, reading the features asked for."""
    mine = (arch.vocab_size, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    theirs = (c.vocab_size, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
    if mine != theirs:
        raise ValueError(f"the head to start from was trained for another model (vocabulary, "
                         f"hidden size, heads, KV heads, head dim {theirs}; the target has "
                         f"{mine})")
    if tuple(c.feature_layers) != tuple(cfg.feature_layers):
        raise ValueError(f"the head to start from reads feature layers "
                         f"{list(c.feature_layers)}, not {list(cfg.feature_layers)}")


def split_sequences(num_seqs: int, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(cfg.seed + 1))
    num_eval = int(num_seqs * cfg.eval_fraction) if num_seqs > 1 else 0
    return order[num_eval:], order[:num_eval]


def _num_steps(num_seqs: int, cfg: TrainConfig) -> int:
    return cfg.epochs * -(-num_seqs // cfg.batch_size)


def _batches(indices: torch.Tensor, cfg: TrainConfig):
    gen = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.epochs):
        yield from indices[torch.randperm(len(indices), generator=gen)].split(cfg.batch_size)


def _schedule(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup * total))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


# -- draft model --------------------------------------------------------------------------


def init_draft_model(target_path: Path, num_layers: int):
    """An HF Llama with the target's embedding, first `num_layers` layers and final norm."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_path)
    if num_layers >= config.num_hidden_layers:
        raise ValueError(f"a draft model needs fewer layers than the target's "
                         f"{config.num_hidden_layers}")
    config.num_hidden_layers = num_layers
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    own = model.state_dict()
    with torch.no_grad():
        for file in sorted(target_path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in own:
                        own[name].copy_(f.get_tensor(name).float())
    return model


def draft_model_vocab(record: TargetRecord, cfg: TrainConfig, vocab_size: int
                      ) -> torch.Tensor | None:
    """The draft vocabulary saved beside a distilled draft model: the target's most frequent
    choices in the training sequences (None when `draft_vocab_size` keeps them all)."""
    if cfg.draft_vocab_size <= 0 or cfg.draft_vocab_size >= vocab_size:
        return None
    train_idx, _ = split_sequences(len(record.tokens), cfg)
    return choose_draft_vocab(record.labels[train_idx], cfg.draft_vocab_size, vocab_size)


def distill_draft(target_path: Path, record: TargetRecord, cfg: TrainConfig,
                  progress: ProgressFn | None = None):
    """Train an early-exit draft model on the target's greedy tokens; returns (model, history)."""
    torch.manual_seed(cfg.seed)
    model = init_draft_model(target_path, cfg.draft_layers).train()
    model.get_input_embeddings().weight.requires_grad_(False)  # shared with the tied LM head
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    train_idx, eval_idx = split_sequences(len(record.tokens), cfg)
    history, total = History(), _num_steps(len(train_idx), cfg)
    for step, idx in enumerate(_batches(train_idx, cfg)):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * _schedule(step, total, cfg)
        loss, agreement = _draft_loss(model, record, idx, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.loss.append(loss.item())
        history.accuracy.append([agreement])
        if progress is not None:
            progress(step + 1, history)
    model.eval()
    with torch.no_grad():
        parts = [_draft_loss(model, record, idx, cfg)[1]
                 for idx in eval_idx.split(cfg.batch_size)]
    history.eval_accuracy = [sum(parts) / len(parts)] if parts else []
    return model, history


def _draft_loss(model, record: TargetRecord, idx: torch.Tensor,
                cfg: TrainConfig) -> tuple[torch.Tensor, float]:
    with bf16_autocast(cfg):
        logits = model(input_ids=record.tokens[idx]).logits.float()  # [b, S, V]
    loss = F.cross_entropy(logits.flatten(0, 1), record.labels[idx].reshape(-1))
    return loss, float((logits.argmax(-1) == record.labels[idx]).float().mean())


def save_draft(model, target_path: Path, out_dir: Path, dtype: torch.dtype,
               draft_vocab: torch.Tensor | None = None) -> None:
    """An HF checkpoint, the target's tokenizer files and a speculator.json (which lists
    the draft vocabulary the proposer restricts its LM head to, when given)."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(str(out_dir), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json", "chat_template.jinja"):
        if (target_path / name).is_file():
            shutil.copy(target_path / name, out_dir / name)
    (out_dir / "speculator.json").write_text(json.dumps(
        {"kind": "draft", "target": target_path.name,
         "num_hidden_layers": model.config.num_hidden_layers,
         "draft_vocab": None if draft_vocab is None else draft_vocab.tolist()}))


def plot_history(history: History, path: Path, title: str) -> None:
    """Loss (and per-step accuracy) against optimizer steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(history.loss, lw=1)
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title=title)
    for j in range(max(map(len, history.accuracy), default=0)):
        points = [(i, a[j]) for i, a in enumerate(history.accuracy) if len(a) > j]
        ax_acc.plot(*zip(*points, strict=True), lw=1, label=f"step {j + 1}")
    ax_acc.set(xlabel="optimizer step", ylabel="top-1 agreement with the target",
               ylim=(0, 1))
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
