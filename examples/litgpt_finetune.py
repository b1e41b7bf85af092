"""LitGPT's own model fine-tuned in a Fabric loop: lean masters (+ torchao's AdamW8bit, + the step inside backward)
against fp32, bf16-true and bf16-mixed.

    pip install psutil && pip install --no-deps litgpt==0.5.13      # litgpt's deps would downgrade huggingface_hub
    python examples/litgpt_finetune.py                               # a few minutes on 2 CPU cores
    python examples/litgpt_finetune.py --pretrain-steps 10 --steps 10   # a quick run
    python examples/litgpt_finetune.py --size small --pretrain-steps 150 --steps 300   # closer to a real run

A small ``litgpt.model.GPT`` (Llama-shaped: RMSNorm, SwiGLU, rotary) with random weights is first pre-trained in
fp32 on one synthetic "language" (a seeded bigram chain over its vocabulary), then fine-tuned from those same weights
on a shifted one at lr 2e-5 (a fine-tuning rate), in each mode, with the same batches:

- ``32-true``: ``L.Fabric(precision="32-true")``: fp32, the reference;
- ``bf16-true``: ``L.Fabric(precision="bf16-true")``, LitGPT's default for fine-tuning: bf16 weights and AdamW
  state; updates below half a bf16 spacing are lost;
- ``bf16-mixed``: ``L.Fabric(precision="bf16-mixed")``: fp32 weights + autocast (16 bytes/parameter with AdamW);
- ``ours+remainder``: ``L.Fabric(plugins=[MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")])``,
  AdamW: bf16 weights + 16-bit remainders, exact fp32 updates;
- ``ours+remainder+8bit``: the same with ``torchao.optim.AdamW8bit`` (about 8 bytes/parameter at rest);
- ``ours+remainder+inbackward``, ``ours+remainder+8bit+inbackward``: the same two with ``optimizer_in_backward=True``
  (``fabric.backward`` updates each parameter and frees its gradient: 12 and about 6 bytes/parameter at rest).

It prints each mode's held-out loss after fine-tuning (evaluated in fp32 from the trained values) and the bytes per
parameter the run holds after its last step (live tensor storages, gradients still held). benchmarks/fabric_litgpt.py runs
the same functions, one fresh process per mode, and adds peak heap and step time.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import lightning as L
import torch

from lightning_mp import MixedPrecisionPlugin

MODES = (
    "32-true",
    "bf16-true",
    "bf16-mixed",
    "ours+remainder",
    "ours+remainder+8bit",
    "ours+remainder+inbackward",
    "ours+remainder+8bit+inbackward",
)
SIZES = {  # litgpt.Config fields; "small" (8.7M parameters) makes the lean step's fixed 2 MiB staging negligible
    "small": dict(n_layer=4, n_head=6, n_embd=384, intermediate_size=1024, vocab_size=2048),
    "tiny": dict(n_layer=2, n_head=4, n_embd=128, intermediate_size=256, vocab_size=512),
}
SEQ, BATCH = 64, 8


def config(size: str = "small") -> Any:
    """A Llama-shaped ``litgpt.Config``."""
    from litgpt import Config

    return Config(
        block_size=SEQ,
        padded_vocab_size=SIZES[size]["vocab_size"],
        n_query_groups=SIZES[size]["n_head"],
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        parallel_residual=False,
        rotary_percentage=1.0,
        **SIZES[size],
    )


def chain(seed: int, vocab: int) -> torch.Tensor:
    """A bigram "language" over ``vocab`` tokens: each token's next-token distribution (peaked: a few likely
    successors)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=generator) * 3.0
    return torch.softmax(logits, dim=-1)


def batches(transitions: torch.Tensor, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` batches of ``BATCH`` sequences of ``SEQ + 1`` tokens drawn from the chain."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, transitions.shape[0], (BATCH,), generator=generator)
        for t in range(SEQ):
            tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=generator).squeeze(1)
        out.append(tokens)
    return out


def loss_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def pretrained(size: str, steps: int) -> dict[str, torch.Tensor]:
    """fp32 weights after ``steps`` AdamW steps (lr 3e-3) on the first chain: the model to fine-tune."""
    from litgpt.model import GPT

    torch.manual_seed(0)
    model = GPT(config(size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for tokens in batches(chain(1, SIZES[size]["vocab_size"]), steps, seed=2):
        loss_of(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fabric_for(mode: str) -> L.Fabric:
    if mode.startswith("ours"):
        in_backward = mode.endswith("inbackward")
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
        return L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    return L.Fabric(accelerator="cpu", devices=1, precision=mode)


def finetune(mode: str, weights: dict[str, torch.Tensor], size: str, steps: int, lr: float = 2e-5) -> dict:
    """Fine-tune ``weights`` in ``mode`` for ``steps`` steps at ``lr``. Returns the last training loss, the bytes
    per parameter of the tensors the run holds after its last step (weights, remainders, gradients, optimizer state:
    every live tensor storage, minus those alive before the model was built), the step times (s) and the trained
    values in fp32 (the exact master values with the plugin: its state-dict hooks)."""
    from litgpt.model import GPT

    data = batches(chain(3, SIZES[size]["vocab_size"]), steps, seed=4)
    before = live_tensor_bytes()
    model = GPT(config(size))
    model.load_state_dict(weights)
    if "8bit" in mode:
        from torchao.optim import AdamW8bit

        optimizer: Any = AdamW8bit(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # built before fabric.setup, as users do
    fabric = fabric_for(mode)
    model, optimizer = fabric.setup(model, optimizer)
    losses, times, at_rest = [], [], 0.0
    params = sum(p.numel() for p in model.parameters())
    for step, tokens in enumerate(data):
        start = time.perf_counter()
        loss = loss_of(model, tokens)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        if step == len(data) - 1:  # between steps: gradients still held, as in a Trainer's loop
            at_rest = (live_tensor_bytes() - before) / params
        optimizer.zero_grad()
    trained = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"mode": mode, "train_loss": losses[-1], "bytes_per_param": at_rest, "step_s": times, "trained": trained}


def held_out_loss(trained: dict[str, torch.Tensor], size: str) -> float:
    from litgpt.model import GPT

    model = GPT(config(size))
    model.load_state_dict(trained)
    with torch.no_grad():
        held_out = batches(chain(3, SIZES[size]["vocab_size"]), 8, seed=5)
        return sum(loss_of(model, tokens).item() for tokens in held_out) / len(held_out)


def live_tensor_bytes() -> int:
    """Bytes of every live plain tensor storage (each storage once): weights, remainders, gradients, optimizer
    state (torchao's 8-bit states are subclasses holding plain tensors, counted through those)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, torch.nn.Parameter):
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--pretrain-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    weights = pretrained(args.size, args.pretrain_steps)
    print(f"held-out loss before fine-tuning: {held_out_loss(weights, args.size):.4f}")
    print(f"{'mode':<22} {'held-out loss':>14} {'bytes/param at rest':>20}")
    for mode in args.modes:
        result = finetune(mode, weights, args.size, args.steps, args.lr)
        loss = held_out_loss(result.pop("trained"), args.size)
        print(f"{mode:<22} {loss:>14.4f} {result['bytes_per_param']:>20.2f}")


if __name__ == "__main__":
    main()
