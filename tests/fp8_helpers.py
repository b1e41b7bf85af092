"""Tiny models and data for the fp8 tests: an HF Llama decoder (a third-party model with plain nn.Linear layers)
on a low-entropy Markov chain of tokens, and a small MLP whose layers exercise every rule of the layer choice."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 64
SEQ = 32


def markov_tokens(samples: int = 64, seed: int = 0) -> torch.Tensor:
    """``samples`` sequences of ``SEQ + 1`` tokens from a fixed random chain where each token has 3 successors."""
    gen = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=gen)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.empty(samples, SEQ + 1, dtype=torch.long)
    rows[:, 0] = torch.randint(0, VOCAB, (samples,), generator=gen)
    for t in range(SEQ):
        pick = torch.randint(0, 3, (samples,), generator=gen)
        rows[:, t + 1] = successors[rows[:, t], pick]
    return rows


def token_loader(samples: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    return DataLoader(TensorDataset(markov_tokens(samples, seed)), batch_size=batch_size, shuffle=False)


class TinyLlama(L.LightningModule):
    """``transformers.LlamaForCausalLM`` at hidden 64 (2 layers, 4 heads): every projection is an nn.Linear whose
    dimensions are multiples of 16, and ``lm_head`` is the output projection."""

    def __init__(self, lr: float = 3e-3, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
        self.model = LlamaForCausalLM(config)
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(input_ids=tokens[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Mixed(nn.Module):
    """One layer for each rule of the layer choice."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)  # converted
        self.odd = nn.Linear(64, 40)  # 40 is not a multiple of 16
        self.attn = nn.MultiheadAttention(40, 4)  # out_proj is a subclass of nn.Linear
        self.keep = nn.Linear(40, 32)  # excluded by the test's fp8_exclude rule
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 16)  # the output projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.odd(torch.relu(self.up(x)))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.norm(self.keep(h)))


class MLPModule(L.LightningModule):
    """A 3-layer MLP classifier (32 -> 64 -> 32 -> 16), optionally with the :class:`Mixed` body."""

    def __init__(self, mixed: bool = False, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = (
            Mixed()
            if mixed
            else nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))
        )
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def mlp_loader(samples: int = 64, batch_size: int = 16) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 32, generator=gen)
    return DataLoader(TensorDataset(x, x[:, :16].argmax(1)), batch_size=batch_size, shuffle=False)


def trainer(plugin: Any, steps: int, **kwargs: Any) -> L.Trainer:
    options = dict(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        deterministic=True,
    )
    return L.Trainer(plugins=[plugin], **{**options, **kwargs})
