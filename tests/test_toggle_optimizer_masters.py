"""``toggle_optimizer`` / ``untoggle_optimizer`` under master weights act on the model's parameters, as under
Lightning's built-in precision (lightning_mp.master.toggle): the GAN recipe (manual optimization, two AdamW) with
``master_weights=True`` trains as Lightning's ``bf16-mixed`` and as the lean masters do.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded

MODES = {"true": True, "lean": "remainder"}


def _plugin(mode: str, in_backward: bool = False) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("bf16-mixed", master_weights=MODES[mode], optimizer_in_backward=in_backward)


class TwoOptimizersToggled(BoringModel):
    """Ported from Lightning's tests/tests_pytorch/core/test_lightning_module.py,
    ``test_toggle_untoggle_2_optimizers_no_shared_parameters``: two optimizers over disjoint layers, some weights frozen
    beforehand; while one optimizer is toggled only its trainable parameters require grad, and untoggle restores
    what was set before. Checked on the model's parameters (what the forward reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer_1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        self.layer_2 = nn.Sequential(
            nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2)
        )
        # set some weights to False to check untoggle works as expected
        self.layer_1[2].weight.requires_grad = False
        self.layer_1[4].weight.requires_grad = False
        self.layer_2[1].weight.requires_grad = False
        self.layer_2[3].weight.requires_grad = False
        self.checked = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_2(self.layer_1(x))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt1, opt2 = self.optimizers()
        self.toggle_optimizer(opt1)
        assert self.layer_1[0].weight.requires_grad is True
        assert self.layer_1[2].weight.requires_grad is False
        assert self.layer_1[4].weight.requires_grad is False
        assert all(p.requires_grad is False for p in self.layer_2.parameters())
        loss = self.step(batch)
        opt1.zero_grad()
        self.manual_backward(loss)
        opt1.step()
        self.untoggle_optimizer(opt1)
        assert self.layer_2[5].weight.requires_grad is True and self.layer_2[1].weight.requires_grad is False

        self.toggle_optimizer(opt2)
        assert all(p.requires_grad is False for p in self.layer_1.parameters())
        assert self.layer_2[1].weight.requires_grad is False
        assert self.layer_2[3].weight.requires_grad is False
        assert self.layer_2[5].weight.requires_grad is True
        loss = self.step(batch)
        opt2.zero_grad()
        self.manual_backward(loss)
        opt2.step()
        self.untoggle_optimizer(opt2)
        assert self.layer_1[0].weight.requires_grad is True and self.layer_1[2].weight.requires_grad is False
        self.checked += 1

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.layer_1.parameters(), lr=0.1), torch.optim.Adam(self.layer_2.parameters(), lr=0.1)]


@pytest.mark.parametrize("mode", ["true", "lean"])
def test_toggle_untoggle_2_optimizers_no_shared_parameters(mode):
    model = TwoOptimizersToggled()
    make_trainer(_plugin(mode), limit_train_batches=3, limit_val_batches=0).fit(model)
    assert model.checked == 3
    assert "toggle_optimizer" not in vars(model)  # teardown removed the plugin's wrapper


def test_toggle_untoggle_inside_backward_is_refused_with_two_optimizers_before_any_step():
    with pytest.raises(ValueError, match="takes exactly one optimizer, got 2"):
        make_trainer(_plugin("lean", in_backward=True), limit_train_batches=3).fit(TwoOptimizersToggled())


class GAN(L.LightningModule):
    """Lightning's GAN recipe (docs: "Manual Optimization", the GAN example): two AdamW, each step toggles its own."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        with seeded():
            self.generator = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))
            self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
        self.discriminator_trainable_in_g_step: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        g_opt, d_opt = self.optimizers()
        ones, zeros = torch.ones(len(z), 1), torch.zeros(len(z), 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        self.toggle_optimizer(g_opt)
        self.discriminator_trainable_in_g_step.append(any(p.requires_grad for p in self.discriminator.parameters()))
        g_loss = bce(self.discriminator(self.generator(z)).float(), ones)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        with self.toggled_optimizer(d_opt):  # the context manager calls the same two methods
            real_loss = bce(self.discriminator(real).float(), ones)
            fake_loss = bce(self.discriminator(self.generator(z).detach()).float(), zeros)
            self.manual_backward((real_loss + fake_loss) / 2)
            d_opt.step()
            d_opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.AdamW(self.generator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
            torch.optim.AdamW(self.discriminator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
        )


def _gan(mode: Optional[str]) -> GAN:
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(
        TensorDataset(torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)), batch_size=8
    )
    model = GAN()
    plugins = None if mode is None else _plugin(mode)
    make_trainer(plugins, max_epochs=2, **({"precision": "bf16-mixed"} if mode is None else {})).fit(model, loader)
    return model


def _max_diff(ours: nn.Module, reference: nn.Module) -> float:
    theirs = dict(reference.named_parameters())
    return max((p.detach() - theirs[name].detach()).abs().max().item() for name, p in ours.named_parameters())


def test_the_gan_recipe_with_fp32_masters_trains_as_the_lean_masters_and_lightnings_bf16_mixed():
    ours, lean, builtin = _gan("true"), _gan("lean"), _gan(None)
    assert not any(ours.discriminator_trainable_in_g_step)  # main at 9108c26: True at every step (masters toggled)
    assert ours.discriminator_trainable_in_g_step == builtin.discriminator_trainable_in_g_step
    # main at 9108c26: 0.15 from both; now the fp32 masters and the lean ones agree to the last ulps, and both are as
    # far from the built-in as the lean step is (AdamW's sign-like update amplifies one-ulp ties in a GAN)
    assert _max_diff(ours, lean) <= 1e-6
    assert _max_diff(ours, builtin) <= _max_diff(lean, builtin) + 1e-6
    assert all(p.dtype == torch.float32 for p in ours.parameters())
