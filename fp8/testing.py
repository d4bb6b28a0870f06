"""Models for tests, benchmarks and examples (as ``torchao.testing``): a small GPT in plain PyTorch.

Every projection is a plain ``nn.Linear`` called through its module (never via
its ``.weight``), so the FP8 engine can swap the Linear layers in place. Not imported by ``import fp8``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model hyper-parameters; ``d_ff`` defaults to ``4 * d_model``."""

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    d_ff: int | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        for name in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``[B, T, C]``; returns the same shape."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network ``d_model -> d_ff -> d_model`` with GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` of shape ``[..., d_model]``."""
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``[B, T, d_model]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only language model with learned positions and an untied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: residual-branch output projections scaled by 1/sqrt(2 * n_layer).
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=resid_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits [B, T, vocab], loss)``; ``loss`` is cross-entropy or ``None``."""
        _, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``[B, T]``; return ``[B, T + n]``."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.seq_len :])
            logits = logits[:, -1, :].float() / max(temperature, 1e-8)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


class GrowingGain(nn.Module):
    """A multiplier ``growth ** step`` (``step`` counts the training forwards, a buffer so checkpoints keep it) for
    :class:`SaturatingMLP` and the Megatron demo of ``benchmarks/auto_fallback.py``."""

    def __init__(self, growth: float) -> None:
        super().__init__()
        self.growth = growth
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    def gain(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.growth ** self.step.to(torch.float64)).to(dtype)


class SaturatingMLP(nn.Module):
    """Four linears where the second one's input grows ``growth`` times per training step and its output is divided
    back: the function is unchanged in exact arithmetic, but delayed scaling (the scale of the previous steps' amax)
    cannot follow that input, so it saturates, and its output gradient (divided by the gain) flushes to zero: the
    persistent trouble automatic fallback acts on (:mod:`fp8.fallback`). 16 classes out of ``d`` features."""

    def __init__(self, d: int = 64, growth: float = 4.0) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d, bias=False)
        self.l2, self.l3 = nn.Linear(d, d), nn.Linear(d, 16)
        self.gain = GrowingGain(growth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.l0(x))
        g = self.gain.gain(h.dtype)
        h = self.l1(h * g) / g
        if self.training:
            self.gain.step += 1
        return self.l3(F.gelu(self.l2(h)))
