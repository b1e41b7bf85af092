"""Port of Lightning's hook-order test for a precision plugin that "modifies the optimization flow".

Source: tests/tests_pytorch/models/test_hooks.py::test_trainer_model_hook_system_fit of
github:Lightning-AI/pytorch-lightning, its ``precision="16-mixed"`` case (CUDA only upstream). Every
LightningModule and Callback hook is recorded; with our plugin (fp16 on CPU, master weights or not) the order
must be exactly Lightning's. The other tests of test_hooks.py do not involve precision and are not ported.
"""

from functools import partial, update_wrapper
from inspect import getmembers, isfunction
from unittest.mock import ANY

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, __version__
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_mp import MixedPrecisionPlugin
from tests.upstream._helpers import MASTER_WEIGHTS, trainer_with


def get_members(cls):
    return {h for h, _ in getmembers(cls, predicate=isfunction) if not h.startswith("_")}


class HookedCallback(Callback):
    def __init__(self, called):
        def call(hook, fn, *args, **kwargs):
            out = fn(*args, **kwargs)
            d = {"name": f"Callback.{hook}"}
            if args:
                d["args"] = args
            if kwargs:
                d["kwargs"] = kwargs
            called.append(d)
            return out

        for h in get_members(Callback):
            attr = getattr(self, h)
            partial_h = partial(call, h, attr)
            update_wrapper(partial_h, attr)
            setattr(self, h, partial_h)

    def state_dict(*args, **kwargs):
        return {"foo": True}


class HookedModel(BoringModel):
    def __init__(self, called):
        super().__init__()
        pl_module_hooks = get_members(LightningModule)
        # remove non-hooks
        pl_module_hooks.difference_update({"optimizers", "log", "log_dict"})
        # remove most `nn.Module` hooks
        module_hooks = get_members(torch.nn.Module)
        module_hooks.difference_update({"forward", "zero_grad", "train"})
        pl_module_hooks.difference_update(module_hooks)

        def call(hook, fn, *args, **kwargs):
            out = fn(*args, **kwargs)
            d = {"name": hook}
            if args:
                d["args"] = args
            elif hook == "train":
                d["args"] = (True,)
            if kwargs:
                d["kwargs"] = kwargs
            called.append(d)
            return out

        for h in pl_module_hooks:
            attr = getattr(self, h)
            partial_h = partial(call, h, attr)
            update_wrapper(partial_h, attr)
            setattr(self, h, partial_h)

    def _train_batch(self, *args, **kwargs):
        if self.automatic_optimization:
            return self._auto_train_batch(*args, **kwargs)
        return self._manual_train_batch(*args, **kwargs)

    @staticmethod
    def _auto_train_batch(trainer, model, batches, device, current_epoch=0, current_batch=0, **kwargs):
        out = []
        for i in range(current_batch, batches):
            out.extend(
                [
                    {"name": "on_before_batch_transfer", "args": (ANY, 0)},
                    {"name": "transfer_batch_to_device", "args": (ANY, device, 0)},
                    {"name": "on_after_batch_transfer", "args": (ANY, 0)},
                    {"name": "Callback.on_train_batch_start", "args": (trainer, model, ANY, i)},
                    {"name": "on_train_batch_start", "args": (ANY, i)},
                    {"name": "forward", "args": (ANY,)},
                    {"name": "training_step", "args": (ANY, i)},
                    {"name": "Callback.on_before_zero_grad", "args": (trainer, model, ANY)},
                    {"name": "on_before_zero_grad", "args": (ANY,)},
                    {"name": "optimizer_zero_grad", "args": (current_epoch, i, ANY)},
                    {"name": "Callback.on_before_backward", "args": (trainer, model, ANY)},
                    {"name": "on_before_backward", "args": (ANY,)},
                    {"name": "backward", "args": (ANY,)},
                    {"name": "Callback.on_after_backward", "args": (trainer, model)},
                    {"name": "on_after_backward"},
                    # note: unscaling happens here in the case of AMP
                    {"name": "Callback.on_before_optimizer_step", "args": (trainer, model, ANY)},
                    {"name": "on_before_optimizer_step", "args": (ANY,)},
                    {
                        "name": "clip_gradients",
                        "args": (ANY,),
                        "kwargs": {"gradient_clip_val": None, "gradient_clip_algorithm": None},
                    },
                    {
                        "name": "configure_gradient_clipping",
                        "args": (ANY,),
                        "kwargs": {"gradient_clip_val": None, "gradient_clip_algorithm": None},
                    },
                    # this is after because it refers to the `LightningModule.optimizer_step` hook which encapsulates
                    # the actual call to `Precision.optimizer_step`
                    {"name": "optimizer_step", "args": (current_epoch, i, ANY, ANY)},
                    *(
                        [{"name": "lr_scheduler_step", "args": (ANY, None)}]
                        if i == (trainer.num_training_batches - 1)
                        else []
                    ),
                    {"name": "Callback.on_train_batch_end", "args": (trainer, model, {"loss": ANY}, ANY, i)},
                    {"name": "on_train_batch_end", "args": ({"loss": ANY}, ANY, i)},
                ]
            )
        return out

    @staticmethod
    def _manual_train_batch(trainer, model, batches, device, **kwargs):
        out = []
        for i in range(batches):
            out.extend(
                [
                    {"name": "on_before_batch_transfer", "args": (ANY, 0)},
                    {"name": "transfer_batch_to_device", "args": (ANY, device, 0)},
                    {"name": "on_after_batch_transfer", "args": (ANY, 0)},
                    {"name": "Callback.on_train_batch_start", "args": (trainer, model, ANY, i)},
                    {"name": "on_train_batch_start", "args": (ANY, i)},
                    {"name": "forward", "args": (ANY,)},
                    {"name": "Callback.on_before_backward", "args": (trainer, model, ANY)},
                    {"name": "on_before_backward", "args": (ANY,)},
                    {"name": "backward", "args": (ANY,)},
                    {"name": "Callback.on_after_backward", "args": (trainer, model)},
                    {"name": "on_after_backward"},
                    # `manual_backward` calls the previous 3
                    {"name": "manual_backward", "args": (ANY,)},
                    {"name": "closure"},
                    {"name": "Callback.on_before_optimizer_step", "args": (trainer, model, ANY)},
                    {"name": "on_before_optimizer_step", "args": (ANY,)},
                    {"name": "training_step", "args": (ANY, i)},
                    {"name": "Callback.on_train_batch_end", "args": (trainer, model, {"loss": ANY}, ANY, i)},
                    {"name": "on_train_batch_end", "args": ({"loss": ANY}, ANY, i)},
                ]
            )
        return out

    @staticmethod
    def _eval_epoch(fn, trainer, model, batches, key, device):
        return [
            {"name": f"Callback.on_{fn}_epoch_start", "args": (trainer, model)},
            {"name": f"on_{fn}_epoch_start"},
            *HookedModel._eval_batch(fn, trainer, model, batches, key, device=device),
            {"name": f"Callback.on_{fn}_epoch_end", "args": (trainer, model)},
            {"name": f"on_{fn}_epoch_end"},
        ]

    @staticmethod
    def _eval_batch(fn, trainer, model, batches, key, device):
        out = []
        outputs = {key: ANY}
        for i in range(batches):
            out.extend(
                [
                    {"name": "on_before_batch_transfer", "args": (ANY, 0)},
                    {"name": "transfer_batch_to_device", "args": (ANY, device, 0)},
                    {"name": "on_after_batch_transfer", "args": (ANY, 0)},
                    {"name": f"Callback.on_{fn}_batch_start", "args": (trainer, model, ANY, i)},
                    {"name": f"on_{fn}_batch_start", "args": (ANY, i)},
                    {"name": "forward", "args": (ANY,)},
                    {"name": f"{fn}_step", "args": (ANY, i)},
                    {"name": f"Callback.on_{fn}_batch_end", "args": (trainer, model, outputs, ANY, i)},
                    {"name": f"on_{fn}_batch_end", "args": (outputs, ANY, i)},
                ]
            )
        return out

    # override so that it gets called
    def configure_model(self): ...

    # override so that it gets called
    def on_validation_model_train(self): ...

    # override so that it gets called
    def on_test_model_train(self): ...

    # override so that it gets called
    def on_predict_model_train(self): ...

    # override so that it gets called
    def prepare_data(self): ...


@pytest.mark.parametrize("master_weights", MASTER_WEIGHTS)
@pytest.mark.parametrize("automatic_optimization", [True, False])
@pytest.mark.parametrize("override_on_validation_model_train", [True, False])
def test_trainer_model_hook_system_fit(
    override_on_validation_model_train, automatic_optimization, master_weights, tmp_path
):
    """Port of tests/tests_pytorch/models/test_hooks.py::test_trainer_model_hook_system_fit (its 16-mixed case).

    Adapted: our plugin on CPU instead of Lightning's on CUDA; the checkpoint holds our plugin's state under
    its class name, as upstream expects of Lightning's.
    """
    called = []

    class TestModel(HookedModel):
        def __init__(self, *args):
            super().__init__(*args)
            self.automatic_optimization = automatic_optimization

        def training_step(self, batch, batch_idx):
            if self.automatic_optimization:
                return super().training_step(batch, batch_idx)
            loss = self.step(batch[0])
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step(lambda: called.append({"name": "closure"}))
            return {"loss": loss}

    model = TestModel(called)

    if not override_on_validation_model_train:
        model.on_validation_model_train = None
    assert is_overridden("on_validation_model_train", model) == override_on_validation_model_train

    callback = HookedCallback(called)
    train_batches = 2
    val_batches = 2
    trainer = trainer_with(
        MixedPrecisionPlugin("16-mixed", master_weights=master_weights),
        default_root_dir=tmp_path,
        max_epochs=1,
        limit_train_batches=train_batches,
        limit_val_batches=val_batches,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        logger=True,
        callbacks=[callback],
    )
    trainer.fit(model)
    saved_ckpt = {
        "callbacks": ANY,
        "epoch": 0,
        "global_step": train_batches,
        "lr_schedulers": ANY,
        "optimizer_states": ANY,
        "pytorch-lightning_version": __version__,
        "state_dict": ANY,
        "loops": ANY,
    }
    saved_ckpt[trainer.precision_plugin.__class__.__qualname__] = ANY
    device = trainer.strategy.root_device
    expected = [
        {"name": "configure_callbacks"},
        {"name": "prepare_data"},
        {"name": "Callback.setup", "args": (trainer, model), "kwargs": {"stage": "fit"}},
        {"name": "setup", "kwargs": {"stage": "fit"}},
        {"name": "configure_model"},
        {"name": "configure_optimizers"},
        {"name": "Callback.on_fit_start", "args": (trainer, model)},
        {"name": "on_fit_start"},
        {"name": "zero_grad"},
        {"name": "Callback.on_sanity_check_start", "args": (trainer, model)},
        {"name": "val_dataloader"},
        {"name": "train", "args": (False,)},
        {"name": "on_validation_model_eval"},
        {"name": "Callback.on_validation_start", "args": (trainer, model)},
        {"name": "on_validation_start"},
        *model._eval_epoch("validation", trainer, model, val_batches, "x", device=device),
        {"name": "Callback.on_validation_end", "args": (trainer, model)},
        {"name": "on_validation_end"},
        *([{"name": "on_validation_model_train"}] if override_on_validation_model_train else []),
        {"name": "Callback.on_sanity_check_end", "args": (trainer, model)},
        {"name": "train_dataloader"},
        {"name": "Callback.on_train_start", "args": (trainer, model)},
        {"name": "on_train_start"},
        {"name": "Callback.on_train_epoch_start", "args": (trainer, model)},
        {"name": "on_train_epoch_start"},
        *model._train_batch(trainer, model, train_batches, device=device),
        {"name": "zero_grad"},
        {"name": "on_validation_model_zero_grad"},
        {"name": "train", "args": (False,)},
        {"name": "on_validation_model_eval"},
        {"name": "Callback.on_validation_start", "args": (trainer, model)},
        {"name": "on_validation_start"},
        *model._eval_epoch("validation", trainer, model, val_batches, "x", device=device),
        {"name": "Callback.on_validation_end", "args": (trainer, model)},
        {"name": "on_validation_end"},
        *([{"name": "on_validation_model_train"}] if override_on_validation_model_train else []),
        {"name": "Callback.on_train_epoch_end", "args": (trainer, model)},
        {"name": "on_train_epoch_end"},  # before ModelCheckpoint because it's a "monitoring callback"
        # `ModelCheckpoint.save_checkpoint` is called here
        {"name": "Callback.state_dict"},
        {"name": "Callback.on_save_checkpoint", "args": (trainer, model, saved_ckpt)},
        {"name": "on_save_checkpoint", "args": (saved_ckpt,)},
        {"name": "Callback.on_train_end", "args": (trainer, model)},
        {"name": "on_train_end"},
        {"name": "Callback.on_fit_end", "args": (trainer, model)},
        {"name": "on_fit_end"},
        {"name": "Callback.teardown", "args": (trainer, model), "kwargs": {"stage": "fit"}},
        {"name": "teardown", "kwargs": {"stage": "fit"}},
    ]
    assert called == expected
