"""A small GPT-style causal language model, readable in one sitting (after nanoGPT), as a LightningModule.

Byte-level: the vocabulary is the 256 byte values, so any text trains without a tokenizer. Every projection is a
plain ``torch.nn.Linear`` whose sizes are multiples of 16 (with the defaults), which is what fp8 converts:
``MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")`` (CLI: ``--mixed_precision.fp8 tensorwise``) trains the
attention and MLP projections in fp8 and keeps the output projection ``lm_head`` in bf16. Validation logs
``val_loss`` (nats per byte) and ``val_ppl`` (its exponential, the per-byte perplexity).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB_SIZE = 256


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The LR factor of step ``step``: linear warm-up over ``warmup`` steps, then cosine from 1 to 0.1 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees itself and the positions before it."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x)) with a 4x wide GELU MLP."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final LayerNorm and the output projection ``lm_head``."""

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        vocab_size: int = VOCAB_SIZE,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}.")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2's scaled init of the projections into the residual
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape (batch, length, vocab) for byte ids ``idx`` of shape (batch, length <= block_size)."""
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} is longer than block_size={self.block_size}.")
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTLanguageModel(L.LightningModule):
    """Next-byte prediction with :class:`GPT`; AdamW with linear warm-up then cosine decay to 10% of ``lr``.

    Args:
        n_layer: transformer blocks (default 4).
        n_head: attention heads per block (default 4).
        n_embd: the width (default 128).
        block_size: bytes of context (default 128); at least the data's ``block_size``.
        dropout: dropout probability (default 0.0: none).
        lr: peak learning rate (default 1e-3).
        weight_decay: AdamW's, on matrices only (default 0.1).
        warmup_steps: optimizer steps of linear warm-up (default 100).

    Batches are (batch, length + 1) byte ids: the model reads the first ``length`` and predicts the last ``length``.
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(n_layer, n_head, n_embd, block_size, dropout)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, batch: Tensor) -> Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("val_loss")
        if loss is not None:
            self.log("val_ppl", torch.exp(loss.detach().float()), prog_bar=True)

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams["lr"],
            betas=(0.9, 0.95),
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1) if self._trainer is not None else 1000
        warmup = min(self.hparams["warmup_steps"], total)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
