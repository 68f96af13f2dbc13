"""Pre-norm and post-norm stacks of the same GPT-2 blocks, for `norm-placement`.

Both layouts use the same modules (named as in HF's GPT2LMHeadModel, so a GPT-2
checkpoint's weights load into either) and differ only in where the layer norms sit:

- pre-norm (GPT-2):          x = x + attn(ln_1(x));  x = x + mlp(ln_2(x));  ln_f at the end
- post-norm (Vaswani 2017):  x = ln_1(x + attn(x));  x = ln_2(x + mlp(x));  no final norm

Embeddings are learned positions plus tokens; the unembedding is tied to the token
embedding, as in GPT-2. No dropout, no cache: this exists to be measured and trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

LAYOUTS = ("pre", "post")
INIT_STD = 0.02  # GPT-2's initializer_range: every weight matrix and embedding
# The matrices of each sublayer, as reported: (sublayer, weight) -> module path in a block
# and the columns of its weight (Conv1D: d_in x d_out) that belong to it.
WEIGHTS = [("attn", "W_Q"), ("attn", "W_K"), ("attn", "W_V"), ("attn", "W_O"),
           ("mlp", "W_in"), ("mlp", "W_out")]


@dataclass(frozen=True)
class StackConfig:
    """The sizes of a stack; the blocks are always GPT-2's (LayerNorm, GELU MLP)."""

    n_layers: int  # blocks
    d_model: int  # residual stream width
    n_heads: int  # attention heads; d_head = d_model / n_heads
    d_mlp: int  # MLP hidden width
    n_ctx: int  # learned positions
    d_vocab: int  # token ids (256 for bytes)
    eps: float = 1e-5  # layer norm epsilon
    act: str = "gelu_new"  # GPT-2's tanh GELU (transformers' ACT2FN name)

    @classmethod
    def gpt2_shaped(cls, n_layers: int, d_model: int, n_heads: int, n_ctx: int,
                    d_vocab: int) -> StackConfig:
        """A stack with GPT-2's proportions: MLP width 4 d_model."""
        return cls(n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_mlp=4 * d_model,
                   n_ctx=n_ctx, d_vocab=d_vocab)

    @classmethod
    def from_hf(cls, config, **sizes) -> StackConfig:
        """Sizes from any HF config (its layer count, widths, heads, context, vocabulary),
        overridden by `sizes` where not None."""
        from blockscope.model.arch import config_get

        d_model = config_get(config, "d_model")
        base = dict(
            n_layers=config_get(config, "n_layers"), d_model=d_model,
            n_heads=config_get(config, "n_heads"),
            d_mlp=config_get(config, "d_mlp", 4 * d_model),
            n_ctx=config_get(config, "n_ctx", 1024), d_vocab=config_get(config, "d_vocab"),
            eps=config_get(config, "eps", 1e-5),
            act=getattr(config, "activation_function", None) or "gelu_new")
        base.update({k: v for k, v in sizes.items() if v is not None})
        if sizes.get("d_model") is not None and sizes.get("d_mlp") is None:
            base["d_mlp"] = 4 * base["d_model"]
        return cls(**base)


class Attention(nn.Module):
    def __init__(self, cfg: StackConfig):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.n_heads = cfg.n_heads
        self.c_attn = Conv1D(3 * cfg.d_model, cfg.d_model)  # W_Q | W_K | W_V, with biases
        self.c_proj = Conv1D(cfg.d_model, cfg.d_model)  # W_O

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2)  # (B, H, T, d_head)
                   for t in self.c_attn(x).split(d, dim=-1))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(d_head)
        return self.c_proj(z.transpose(1, 2).reshape(B, T, d))


class MLP(nn.Module):
    def __init__(self, cfg: StackConfig):
        from transformers.activations import ACT2FN
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.c_fc = Conv1D(cfg.d_mlp, cfg.d_model)  # W_in
        self.c_proj = Conv1D(cfg.d_model, cfg.d_mlp)  # W_out
        self.act = ACT2FN[cfg.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: StackConfig, layout: str):
        super().__init__()
        self.layout = layout
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "pre":
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))


class Stack(nn.Module):
    """Embeddings, n_layers blocks of one layout, (pre-norm only) ln_f, and the unembedding:
    tied to the token embedding (`tie`, GPT-2's and the 2017 Transformer's), or its own
    `lm_head` matrix."""

    def __init__(self, cfg: StackConfig, layout: str, tie: bool = True):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}")
        self.cfg, self.layout, self.tie = cfg, layout, tie
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.d_vocab, cfg.d_model), wpe=nn.Embedding(cfg.n_ctx, cfg.d_model),
            h=nn.ModuleList(Block(cfg, layout) for _ in range(cfg.n_layers)),
            ln_f=nn.LayerNorm(cfg.d_model, eps=cfg.eps)))
        if not tie:
            self.lm_head = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)

    def forward(self, ids: torch.Tensor, resid: list | None = None) -> torch.Tensor:
        """Logits (B, T, d_vocab) for ids (B, T); `resid` collects each block's output."""
        t = self.transformer
        x = t.wte(ids) + t.wpe(torch.arange(ids.shape[1], device=ids.device))  # (B, T, d)
        for block in t.h:
            x = block(x)
            if resid is not None:
                resid.append(x.detach())
        if self.layout == "pre":
            x = t.ln_f(x)
        return x @ (t.wte.weight if self.tie else self.lm_head.weight).T  # (B, T, d_vocab)

    def loss(self, ids: torch.Tensor, resid: list | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy over ids (B, T)."""
        logits = self(ids[:, :-1], resid)  # at least float32 for the softmax
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               ids[:, 1:].reshape(-1))

    def weight_grads(self, layer: int) -> dict[tuple[str, str], torch.Tensor]:
        """The gradient of each reported matrix of block `layer` (after a backward)."""
        b, d = self.transformer.h[layer], self.cfg.d_model
        qkv = b.attn.c_attn.weight.grad  # (d_model, 3 d_model)
        return {("attn", "W_Q"): qkv[:, :d], ("attn", "W_K"): qkv[:, d : 2 * d],
                ("attn", "W_V"): qkv[:, 2 * d :], ("attn", "W_O"): b.attn.c_proj.weight.grad,
                ("mlp", "W_in"): b.mlp.c_fc.weight.grad, ("mlp", "W_out"): b.mlp.c_proj.weight.grad}


def init_weights(stack: Stack, *, scaled: bool, seed: int) -> Stack:
    """GPT-2's initialization from `seed`: every matrix and embedding N(0, 0.02), biases 0,
    norms 1 and 0; with `scaled`, the output projections of attention and MLP (the writes
    to the stream) N(0, 0.02 / sqrt(2 n_layers)), as GPT-2 does."""
    gen = torch.Generator().manual_seed(seed)
    proj_std = INIT_STD / math.sqrt(2 * stack.cfg.n_layers) if scaled else INIT_STD
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name:  # ln_1, ln_2, ln_f weights
                p.fill_(1.0)
            else:
                std = proj_std if name.endswith("c_proj.weight") else INIT_STD
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return stack


def load_gpt2_weights(stack: Stack, hf_model) -> Stack:
    """Copy a GPT2LMHeadModel's weights into `stack` (the names are the same)."""
    theirs = hf_model.state_dict()
    mine = stack.state_dict()
    missing = [k for k in mine if k not in theirs]
    if missing:
        raise ValueError(f"not a GPT-2 checkpoint of these sizes: no {missing[0]}")
    stack.load_state_dict({k: theirs[k] for k in mine})
    return stack
