"""An EAGLE-style draft head: one small decoder layer riding on the target's hidden states.

At position p the head reads the target's features F_p (its final hidden state, optionally
with intermediate layers' outputs, EAGLE-3 style) and the embedding of the next token
t_{p+1}, and predicts h_{p+1}, an estimate of the target's feature at p + 1; the target's own
LM head (restricted to a frequent-token draft vocabulary) turns that into a guess for
t_{p+2}. The head then runs on its own outputs: (h_{p+1}, draft_1) -> h_{p+2} -> draft_2, ...

  x = fc([embed(t_{p+1}); g_p])     g_p = fuse(F_p) for verified positions, h_p for drafts
  h_{p+1} = DecoderLayer(x)         attention over the head's own KV of earlier positions
  logits = lm_head_rows(norm(h_{p+1}))

Attention comes in three shapes with one meaning ("step 1 keys causally, then this round's
own draft keys"): over verified positions the head attends its paged KV cache (same slots as
the target, so prefix caching and rollback come free); draft steps attend that context plus
their own path's earlier draft keys (kiln.speculative.head.proposer's `DraftRows`: each draft row a paged
sequence of its own); training unrolls the same chain for every position at once
(kiln.speculative.training.train). The embedding and LM head are the target's; the
head owns `fuse`, `fc`, the layer and a norm (a few million parameters). The proposer that
runs it inside the engine is kiln.speculative.head.proposer.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.layers.linear import Linear, get_linear_method, use_kernels
from kiln.models.loader import dense_method
from kiln.platform import KernelSet, Platform

HEAD_WEIGHTS = "head.safetensors"
FINAL = -1  # feature layer id of the target's final (normed) hidden state


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # target token ids the head can propose (most frequent first)
    feature_layers: tuple[int, ...] = (FINAL,)  # FINAL, or i = output of target layer i
    target: str = ""  # the target model it was trained for (informational)
    kind: str = "head"

    @classmethod
    def for_target(cls, arch, draft_vocab_size: int, feature_layers=(FINAL,),
                   target: str = "", intermediate_size: int | None = None) -> HeadConfig:
        return cls(arch.hidden_size, intermediate_size or arch.intermediate_size,
                   arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps,
                   arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings,
                   arch.vocab_size, draft_vocab_size, tuple(feature_layers), target)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> HeadConfig:
        raw = json.loads(text)
        raw["feature_layers"] = tuple(raw["feature_layers"])
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, D] (rotate-half layout, as the target)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class HeadLayer(nn.Module):
    """A pre-norm Llama decoder layer in plain torch (HF weight names). Attention is a
    callable (q [T, Hq, D], k, v [T, Hkv, D], after rotary) -> [T, Hq * D]."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        h, q_size, kv_size = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.c = c
        self.input_layernorm = nn.Parameter(torch.ones(h, device="cpu"))
        self.q_proj, self.o_proj = nn.Linear(h, q_size, bias=False), nn.Linear(q_size, h, False)
        self.k_proj, self.v_proj = nn.Linear(h, kv_size, bias=False), nn.Linear(h, kv_size, False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h, device="cpu"))
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.fused: nn.ModuleList | None = None  # (qkv, gate_up) packed linears, for inference
        self.fused_ops = None

    def forward(self, x, cos, sin, attend) -> torch.Tensor:
        c = self.c
        if self.fused is not None:
            return self._forward_fused(x, cos, sin, attend)
        a = rms_norm(x, self.input_layernorm, c.rms_norm_eps)
        q = apply_rotary(self.q_proj(a).view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(a).view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = self.v_proj(a).view(-1, c.num_kv_heads, c.head_dim)
        h = x + self.o_proj(attend(q, k, v))
        m = rms_norm(h, self.post_attention_layernorm, c.rms_norm_eps)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def _forward_fused(self, x, cos, sin, attend) -> torch.Tensor:
        """Inference (see `pack_for_inference`): q/k/v and gate/up as one packed linear
        each, norms and SiLU through the target's ops (its C++ kernels where they build)."""
        c, ops, (qkv_proj, gate_up_proj) = self.c, self.fused_ops, self.fused
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = qkv_proj(ops.rms_norm(x, self.input_layernorm, c.rms_norm_eps))
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = apply_rotary(q.reshape(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.reshape(-1, c.num_kv_heads, c.head_dim), cos, sin)
        h = x + self.o_proj(attend(q, k, v.reshape(-1, c.num_kv_heads, c.head_dim)))
        m = ops.rms_norm(h, self.post_attention_layernorm, c.rms_norm_eps)
        return h + self.down_proj(ops.silu_mul(gate_up_proj(m)))


class EagleHead(nn.Module):
    def __init__(self, c: HeadConfig, draft_vocab: torch.Tensor | None = None):
        super().__init__()
        self.c = c
        n_feat, h = len(c.feature_layers), c.hidden_size
        self.fuse = nn.Linear(n_feat * h, h, bias=False) if n_feat > 1 else None
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = HeadLayer(c)
        self.norm = nn.Parameter(torch.ones(h, device="cpu"))
        ids = torch.arange(c.draft_vocab_size, device="cpu") if draft_vocab is None else draft_vocab
        self.register_buffer("draft_vocab", ids.to(torch.int64))  # [Vd] target ids

    def features(self, target_features: torch.Tensor) -> torch.Tensor:
        """[T, n_feat * H] target features -> [T, H] (g for verified positions)."""
        return target_features if self.fuse is None else self.fuse(target_features)

    def forward(self, g: torch.Tensor, token_emb: torch.Tensor, cos, sin, attend) -> torch.Tensor:
        """One step at T positions: -> h [T, H] (the next feature estimate, pre-norm)."""
        return self.layer(self.fc(torch.cat((token_emb, g.to(token_emb.dtype)), dim=-1)),
                          cos, sin, attend)

    def logits(self, h: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, Vd] over the draft vocabulary; lm_rows = target LM head rows."""
        return F.linear(rms_norm(h, self.norm, self.c.rms_norm_eps), lm_rows)


def save_head(head: EagleHead, out_dir: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(dtype if t.is_floating_point() else t.dtype).contiguous()
               for name, t in head.state_dict().items()}
    save_file(tensors, str(out_dir / HEAD_WEIGHTS))
    (out_dir / "speculator.json").write_text(head.c.to_json())


def load_head(path: str | Path, dtype: torch.dtype) -> EagleHead:
    from safetensors.torch import load_file

    path = Path(path)
    config = HeadConfig.from_json((path / "speculator.json").read_text())
    tensors = load_file(str(path / HEAD_WEIGHTS))
    head = EagleHead(config, tensors["draft_vocab"])
    head.load_state_dict(tensors)
    return head.to(dtype).eval().requires_grad_(False)


def packed_linear(weight: torch.Tensor, int8: bool = False,
                  platform: Platform | None = None) -> nn.Module:
    """A kiln Linear holding `weight` [out, in] in the dense format the target's own layers
    use (`kiln.models.loader.dense_method` for `platform`'s linear backend: on a CPU
    oneDNN-prepacked bf16 where available, kiln's bf16-weight kernel on CPUs without bf16
    instructions, torch's generic bf16 matrix-vector product being several times slower; on a
    GPU plain weights through cuBLAS). With `int8`, where an int8 weight-only kernel serves
    the platform (`int8_gemv_available`), decode-sized inputs take int8 rows instead
    (`SmallBatchInt8`). Built on the CPU (the LinearMethod contract), then moved to
    `platform`'s device (None: left on the CPU, with the CPU's choices)."""
    backend = "auto" if platform is None else platform.linear_backend
    linear: nn.Module = _linear(weight, dense_method(weight.dtype, backend))
    if int8 and int8_gemv_available(platform):
        linear = _small_batch_int8(linear, weight, platform)
    return linear if platform is None else linear.to(platform.device)


def _small_batch_int8(dense: Linear, weight: torch.Tensor,
                      platform: Platform | None) -> SmallBatchInt8:
    int8 = _linear(weight, "int8")
    if platform is None or platform.kernels is not KernelSet.TRITON:
        return SmallBatchInt8(dense, int8)
    use_kernels(int8, platform.kernels)  # kiln's Triton GEMV, up to the rows it serves
    return SmallBatchInt8(dense, int8, int8.method.triton_gemv_rows)


def _linear(weight: torch.Tensor, method_name: str) -> Linear:
    if method_name == "int8":
        import kiln.quant.linear  # noqa: F401  (registers the quantized formats)
    method = get_linear_method(method_name)
    layer = Linear(weight.shape[1], weight.shape[0], dtype=weight.dtype, method=method)
    method.load_shard(layer, 0, "weight", weight)
    method.finalize(layer)
    return layer


def int8_gemv_available(platform: Platform | None = None) -> bool:
    """Whether an int8 weight-only kernel serves decode-sized inputs on `platform`: kiln's
    Triton GEMV with the Triton kernel set (a GPU, or the interpreter in tests), kiln's C++
    int8 GEMV on a CPU where it builds; on a GPU without Triton, none (dequantizing each call
    would cost more than the bytes it saves)."""
    if platform is not None and platform.kernels is KernelSet.TRITON:
        return True
    if platform is not None and platform.device.type != "cpu":
        return False
    from kiln.kernels import cpu as cpu_kernels
    from kiln.kernels.quant_mm import INT8_GEMV_MAX_TOKENS

    return INT8_GEMV_MAX_TOKENS > 0 and cpu_kernels.load()


# rows up to which a head's int8 copy beats a oneDNN-packed bf16 one: weights from memory
# (`benchmarks/int8_gemv.py --tokens 1,2,3,4,6,8 --threads 2 --copies 64`, 2-core AMD EPYC
# with AVX-512 BF16; 576x1536 / 1536x576, microseconds): 4 rows 61 / 61 against 77 / 75,
# 6 rows 107 / 101 against 75 / 74, 8 rows 146 / 127 against 94 / 89
ONEDNN_MAX_INT8_ROWS = 4


class SmallBatchInt8(nn.Module):
    """One weight, two copies: int8 weight-only rows (per-row scales) through kiln's int8
    GEMV kernel for inputs of at most INT8_GEMV_MAX_TOKENS rows, the dense packed weight for
    larger ones (a catch-up over a whole prompt). A head's weights come from memory at every
    draft step (the target's forward in between evicts them from cache): half the bytes made
    a head's work per drafting step about 30% cheaper here, with the same drafts. Against
    oneDNN's bf16 linear (AVX-512 BF16) the int8 kernel's fp32 arithmetic loses from about 5
    rows, where a wide tree's beam drafts (ONEDNN_MAX_INT8_ROWS)."""

    def __init__(self, dense: Linear, int8: Linear, max_rows: int | None = None):
        """`max_rows`: the most rows the int8 copy serves (None: kiln's C++ int8 GEMV's)."""
        super().__init__()
        from kiln.kernels.quant_mm import INT8_GEMV_MAX_TOKENS
        from kiln.models.layers.onednn import OneDNNLinearMethod

        self.dense, self.int8 = dense, int8
        self.max_rows = INT8_GEMV_MAX_TOKENS if max_rows is None else max_rows
        if isinstance(dense.method, OneDNNLinearMethod):
            self.max_rows = min(self.max_rows, ONEDNN_MAX_INT8_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8(x) if x.shape[0] <= self.max_rows else self.dense(x)


def pack_for_inference(head: EagleHead, ops=None, int8: bool = False,
                       platform: Platform | None = None) -> EagleHead:
    """Swap every nn.Linear of a loaded head for a `packed_linear` (same math; with `int8`,
    int8 weight-only rows for decode-sized inputs), with q/k/v and gate/up concatenated into
    one each, and norms and SiLU through `ops` (the target's: kiln.models.layers.ops) when
    given. With `platform`, in its formats and on its device, every tensor of the head moved
    there (the target's runner's: the head reads its hidden states and KV)."""
    layer = head.layer
    if ops is not None:
        cat = torch.cat
        # registered modules (not a plain tuple), so that moving the head moves them
        layer.fused = nn.ModuleList([
            packed_linear(cat([layer.q_proj.weight, layer.k_proj.weight,
                               layer.v_proj.weight]).data, int8, platform),
            packed_linear(cat([layer.gate_proj.weight, layer.up_proj.weight]).data, int8,
                          platform)])
        layer.fused_ops = ops
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            delattr(layer, name)
    for module in list(head.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, packed_linear(child.weight.data, int8, platform))
    return head if platform is None else head.to(platform.device)


def stack_weights(head: EagleHead) -> list[tuple[float, dict, bool]] | None:
    """The packed head's decoder layer as `kiln::llama_stack` takes it (one layer), per input
    size: [(most rows, {projection: (weight, scale)}, plain_bf16)], fewest rows first. Where
    the layer's linears carry int8 copies (`SmallBatchInt8`), those serve up to their row
    limit; the dense copy (oneDNN-packed bf16, or plain bf16 through kiln's bf16_gemm up to its
    row limit) serves the rest. None where the layer is not packed in those forms (an fp32
    head, the reference ops)."""
    from kiln.kernels.bf16_mm import BF16_GEMM_MAX_TOKENS
    from kiln.models.layers.cpu_bf16 import CpuBf16LinearMethod
    from kiln.runner.fused_stack import stack_linear_tensors

    layer = head.layer
    if layer.fused is None:
        return None
    linears = {"qkv": layer.fused[0], "o": layer.o_proj, "gate_up": layer.fused[1],
               "down": layer.down_proj}
    dense = {name: m.dense if isinstance(m, SmallBatchInt8) else m
             for name, m in linears.items()}
    tensors = {name: stack_linear_tensors(m) for name, m in dense.items()}
    if None in tensors.values() or any(t[1].numel() for t in tensors.values()):
        return None
    plain = any(isinstance(m.method, CpuBf16LinearMethod) for m in dense.values())
    sets = [(BF16_GEMM_MAX_TOKENS if plain else math.inf, tensors, plain)]
    if all(isinstance(m, SmallBatchInt8) for m in linears.values()):
        small = {name: stack_linear_tensors(m.int8) for name, m in linears.items()}
        if None not in small.values():
            sets.insert(0, (min(m.max_rows for m in linears.values()), small, False))
    return sets


# -- inference helpers (kiln.speculative.head.proposer) ----------------------------------------------------------


class FeatureTap:
    """The target features a head reads at given flat token rows: the final hidden state
    (FINAL) and/or the residual stream after chosen decoder layers, captured by forward hooks
    during each target forward (so the target's own code needs no changes)."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...]):
        self.layers = layers
        self._captured: dict[int, torch.Tensor] = {}
        for i in layers:
            if i != FINAL:
                model.model.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def capture(module, args, output):
            x, residual = output if isinstance(output, tuple) else (output, None)
            self._captured[i] = x if residual is None else x + residual
        return capture

    def features(self, final_hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """[len(index), n_feat * H] (each feature's rows at `index`, concatenated)."""
        return torch.cat([final_hidden[index] if i == FINAL else self._captured[i][index]
                          for i in self.layers], dim=-1)


def lm_head_rows(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head weight rows for `ids` ([Vd, H]); the embedding when tied."""
    dense = getattr(model.lm_head.method, "dense_weight", None)
    if dense is None:  # a quantized LM head: its tied embedding rows
        return model.model.embed_tokens.weight[ids].contiguous()
    return dense(model.lm_head)[ids].contiguous()
