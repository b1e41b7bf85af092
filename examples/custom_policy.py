"""A custom casting policy: keep the classifier head and the attention softmax in fp32, see what changed.

    python examples/custom_policy.py

Prints the policy's decisions (`describe()`), then trains a tiny BERT for a few steps on made-up token ids
under the policy, declared the two ways a user can: on the plugin, and on the LightningModule with
`configure_precision_policy()` (the module's declaration wins where they disagree).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_mp import CastPolicy, MixedPrecisionPlugin
from lightning_mp.samples.models import BertClassifier

TINY_BERT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128}


class HeadInFp32(BertClassifier):
    """The sample BERT classifier, declaring that its classification head runs in fp32."""

    def configure_precision_policy(self) -> dict:
        return {"fp32_modules": ["model.classifier"]}


class TokenIds(Dataset):
    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, 2000, (count, 16), generator=generator)
        self.labels = (self.ids[:, 0] > 1500).long()  # something learnable

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {
            "input_ids": self.ids[index],
            "attention_mask": torch.ones(16, dtype=torch.long),
            "labels": self.labels[index],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    policy = CastPolicy(preset="autocast", fp32_ops=["softmax"])
    print(policy.describe("cpu"))
    plugin = MixedPrecisionPlugin("bf16-mixed", policy=policy)
    model = HeadInFp32("minilm", pretrained=False, config_overrides=TINY_BERT, lr=1e-3)
    trainer = L.Trainer(
        plugins=[plugin],
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TokenIds(256), batch_size=16))
    print(f"effective policy: {plugin.effective_policy!r}")
    print(f"final training loss: {trainer.callback_metrics['train_loss'].item():.4f}")


if __name__ == "__main__":
    main()
