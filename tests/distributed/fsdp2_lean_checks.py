"""2-rank FSDP2 checks of lean master weights (run by tests/test_lean_masters_fsdp2.py).

    python tests/distributed/fsdp2_lean_checks.py OUT

bf16-mixed, ``master_weights="remainder"``, ModelParallelStrategy + fully_shard (the norm on its own in fp32): the
uninterrupted run (inf in rank 0's shard at step INJECT_AT, norm clipping, a distributed checkpoint after epoch 0),
the run resumed from it, the same from a full single-file checkpoint, gradient accumulation (fp32 sums, then bf16),
a casting-policy fp32 head, the norm left in the bf16 group, fp32 masters (``True``) for comparison, AdamW, SGD and
NAdam runs whose steps are replayed on fp32 shards with torch's fused (NAdam: foreach) optimizers, the live tensors at
rest, and the same for torchao's 8-bit Adam (in one pass on the local shards) and an optimizer on the generic path
(RMSprop): ``generic_runs``. Each rank
saves what it saw to OUT/rank<r>.pt.
"""

from __future__ import annotations

import gc
import getpass
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.master.lean.chunked import local_of
from tests.distributed.common import GLOBAL_BATCH, Net, _full, finish, fit, loader, save, shard_net
from tests.distributed.fsdp2_checks import POLICY, shard_net_whole, shard_with_fp32_head
from tests.helpers import saved_copy


def strategy(**kwargs: Any) -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, **kwargs)


def _trainer(plugin: MixedPrecisionPlugin, **kwargs: Any) -> L.Trainer:
    """A quiet 2-rank FSDP2 Trainer without checkpoints; ``kwargs`` say how long it trains."""
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy(),
        plugins=[plugin],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        **kwargs,
    )


class AdamWNet(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class Unclipped:
    """No clipping: the replay's reference is torch's optimizer alone (clipping is compared with one process)."""

    def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
        pass


class ReplayAdamW(Unclipped, AdamWNet):
    pass


class ReplaySGD(Unclipped, Net):
    pass


class ReplayNAdam(Unclipped, Net):
    """NAdam: the table's entry without a one-pass kernel (torch's foreach function on the fp32 shards, chunked)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.NAdam(self.parameters(), lr=1e-2, weight_decay=0.1)


class Probe(L.Callback):
    """At the first step: the first layer's gradient dtype (fp32 when micro-batches add up in fp32) and the norm's
    parameter dtype (fp32 in its own group; bf16, with a remainder, when left in the bf16 group)."""

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        module.record.setdefault("grad_dtype", local_of(module.net[0].weight.grad).dtype)
        module.record.setdefault("norm_dtype", local_of(module.net[1].weight).dtype)


class Replay(L.Callback):
    """This rank's exact fp32 shards before training and every step's gradient shards, for a replay on fp32."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        masters = trainer.precision_plugin.masters
        module.record["initial"] = [local_of(masters.fp32_value(p)).clone() for p in module.parameters()]
        module.record["seen"] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        module.record["seen"].append([local_of(p.grad).detach().clone() for p in module.parameters()])

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        masters = trainer.precision_plugin.masters
        module.record["final"] = [local_of(masters.fp32_value(p)).clone() for p in module.parameters()]


class Refollow(L.Callback):
    """At the second step: the store follows the same optimizers again (what it does when the Trainer's list of
    optimizers is set again mid-fit); the optimizer's load hooks before and after, counted."""

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
        if trainer.global_step != 1:
            return
        optimizer = trainer.optimizers[0]

        def hooks() -> tuple[int, int]:
            return (
                len(optimizer._optimizer_load_state_dict_pre_hooks),
                len(optimizer._optimizer_load_state_dict_post_hooks),
            )

        before = hooks()
        trainer.precision_plugin.masters.follow_optimizers(trainer.optimizers)
        module.record["load_hooks"] = (before, hooks())


class AtRest(L.Callback):
    """At the second step, before the optimizer: every live tensor storage of this rank, by what it holds."""

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != 1:
            return
        masters = trainer.precision_plugin.masters
        remainders = masters.remainders
        params = list(module.parameters())
        converted = [p for p in params if id(p) in remainders]

        def ptr(t: torch.Tensor) -> int:
            return local_of(t).untyped_storage().data_ptr()

        states = [local_of(v) for s in optimizer.state.values() for k, v in s.items() if k != "step"]
        known = {ptr(t) for t in states} | {ptr(p) for p in params} | {ptr(p.grad) for p in params}
        known |= {ptr(t) for t in remainders.values()} | {t.untyped_storage().data_ptr() for t in _staging(masters)}
        exact = [local_of(masters.fp32_value(p)).reshape(-1) for p in converted]
        known |= {t.untyped_storage().data_ptr() for t in exact}  # made here, to compare with
        copies, others = 0, 0
        for obj in gc.get_objects():
            if type(obj) is not torch.Tensor or obj.dtype != torch.float32 or obj.untyped_storage().nbytes() == 0:
                continue
            if obj.untyped_storage().data_ptr() in known:
                continue
            others += obj.untyped_storage().nbytes()
            flat = obj.detach().reshape(-1)
            copies += sum(flat.numel() == e.numel() and e.numel() > 0 and torch.equal(flat, e) for e in exact)
        module.record["rest"] = {
            "local_numel": sum(local_of(p).numel() for p in converted),
            "shard_dtypes": {local_of(p).dtype for p in converted},
            "grad_dtypes": {(type(p.grad).__name__, p.grad.dtype) for p in converted},
            "kept_dtypes": {local_of(p).dtype for p in params if id(p) not in remainders},
            # the bf16 shard is a view of FSDP2's own padded storage, the one it all-gathers
            "fsdp_storage": all(ptr(masters._shards[id(p)][0]._sharded_param_data) == ptr(p) for p in converted),
            "shard_bytes": sum(local_of(p).numel() * local_of(p).element_size() for p in converted),
            "remainder_bytes": sum(remainders[id(p)].untyped_storage().nbytes() for p in converted),
            "grad_bytes": _storage_bytes(local_of(p.grad) for p in converted),
            "state_bytes": sum(
                local_of(v).untyped_storage().nbytes()
                for p in converted
                for k, v in optimizer.state[p].items()
                if k != "step"
            ),
            "fp32_copies_of_shards": copies,
            "other_fp32_bytes": others,
        }


class WideNet(Net):
    """A layer whose local shards hold 4096 values (torchao quantises state from 4096 values) between the others."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        linear = torch.nn.Linear
        self.net = torch.nn.Sequential(
            linear(4, 64), torch.nn.LayerNorm(64), torch.nn.Tanh(), linear(64, 128), torch.nn.Tanh(), linear(128, 1)
        )
        self.net[0].register_forward_pre_hook(self._record_compute_dtype)
        self.net[3].register_forward_hook(self._record_head_dtypes)


class Wide8bit(WideNet):
    def configure_optimizers(self) -> Any:
        from torchao.optim import AdamW8bit

        return AdamW8bit(self.parameters(), lr=1e-2, weight_decay=0.1)


class WideAdam8bit(WideNet):
    def configure_optimizers(self) -> Any:
        from torchao.optim import Adam8bit

        return Adam8bit(self.parameters(), lr=1e-2, weight_decay=0.1)


class WideRMSprop(WideNet):
    def configure_optimizers(self) -> Any:
        return torch.optim.RMSprop(self.parameters(), lr=1e-3, momentum=0.5, foreach=False)


class LocalMomentum(torch.optim.Optimizer):
    """Momentum kept as plain tensors of the local shards' shape: a distributed checkpoint would save rank 0's."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                local, grad = local_of(param), local_of(param.grad)
                buffer = self.state[param].setdefault("buffer", torch.zeros_like(local))
                local.add_(buffer.mul_(0.9).add_(grad), alpha=-group["lr"])


class WideLocalState(WideNet):
    def configure_optimizers(self) -> Any:
        return LocalMomentum(self.parameters())


class GenericAtRest(L.Callback):
    """At the second step, before the optimizer: the optimizer state's kinds and bytes, and fp32 copies of shards."""

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != 1:
            return
        masters = trainer.precision_plugin.masters
        converted = [p for p in module.parameters() if id(p) in masters.remainders]
        exact = [local_of(masters.fp32_value(p)).reshape(-1) for p in converted]
        known = {t.untyped_storage().data_ptr() for t in exact}
        copies = 0
        for obj in gc.get_objects():
            if type(obj) is not torch.Tensor or obj.dtype != torch.float32 or obj.untyped_storage().nbytes() == 0:
                continue
            if obj.untyped_storage().data_ptr() not in known:
                flat = obj.detach().reshape(-1)
                copies += sum(flat.numel() == e.numel() > 0 and torch.equal(flat, e) for e in exact)
        states = [(k, v) for state in optimizer.state.values() for k, v in state.items() if k != "step"]
        params = {id(p) for p in module.parameters()}
        module.record["rest"] = {
            "keyed_by_params": all(id(p) in params for p in optimizer.state),
            "state_kinds": {(type(v).__name__, type(local_of(v)).__name__) for _, v in states},
            "proxy_bytes": sum(local_of(p).untyped_storage().nbytes() for p in optimizer.state),
            "fp32_copies_of_shards": copies,
            "state_bytes": sum(t.untyped_storage().nbytes() for _, v in states for t in _inner(local_of(v))),
            "local_numel": sum(local_of(p).numel() for p in module.parameters()),
        }


class StepKind(L.Callback):
    """Which step the lean store runs the optimizer with: ``ShardedAdam8bitStep`` (torchao's 8-bit Adam in one pass
    on the local shards), ``ShardedGenericStep`` (the generic path on proxies), ``None`` (the table's)."""

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        update = trainer.precision_plugin.masters.updates.get(optimizer)
        step = update.generic if update is not None else None
        module.record["step_kind"] = type(step).__name__ if step is not None else None


@contextmanager
def no_kernels(off: bool = True) -> Iterator[None]:
    """``LIGHTNING_MP_NATIVE=0`` inside (with ``off``): torchao's 8-bit Adam takes the generic path, as where no C
    compiler is found."""
    before = os.environ.get("LIGHTNING_MP_NATIVE")
    if off:
        os.environ["LIGHTNING_MP_NATIVE"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LIGHTNING_MP_NATIVE", None)
        else:
            os.environ["LIGHTNING_MP_NATIVE"] = before


def _inner(tensor: torch.Tensor) -> list[torch.Tensor]:
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if type(tensor) is torch.Tensor or flatten is None:
        return [tensor]
    return [t for name in flatten()[0] for t in _inner(getattr(tensor, name))]


class Edit8bit(L.Callback):
    """An edit of torchao's AdamW8bit between steps, as in tests/optimizer_edits.py (under FSDP2 its state is
    ``DTensor`` s of the local shards): ``reset``, the first layer's state emptied at step 2; ``load``, the
    optimizer's ``state_dict`` of step 1 loaded back at step 3; ``lr``, every group's lr tensor filled at step 2. With
    ``rebuild``, the one-pass step's layouts are made again before every backward (the reference)."""

    def __init__(self, how: str, rebuild: bool) -> None:
        self.how, self.rebuild = how, rebuild
        self.saved: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
        optimizer, step = trainer.optimizers[0], trainer.global_step
        if self.how == "reset" and step == 2:
            for param in module.net[0].parameters():
                optimizer.state[param] = {}
        elif self.how == "load" and step == 1:
            self.saved = saved_copy(optimizer.state_dict())
        elif self.how == "load" and step == 3:
            optimizer.load_state_dict(self.saved)
        elif self.how == "lr" and step == 2:
            for group in optimizer.param_groups:
                group["lr"].fill_(3e-3)

    def on_before_backward(self, trainer: L.Trainer, module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.rebuild:
            trainer.precision_plugin.masters.updates.of(trainer.optimizers[0]).generic.follow_groups()


def generic_runs(out: Path) -> dict[str, Any]:
    """torchao's AdamW8bit (in one pass on the local shards) and torch's for-loop RMSprop (the generic path): a run
    with an inf in rank 0's shard at INJECT_AT, clipping and a distributed checkpoint after epoch 0, the run resumed
    from it, whole-file checkpoints, and a replay; Adam8bit's replay; AdamW8bit's replay and whole-file refusal on the
    generic path (no kernels, as without a compiler); a per-parameter state that is not sharded (refused); edits of
    AdamW8bit's state and options between steps, each with its reference (:class:`Edit8bit`)."""
    results: dict[str, Any] = {}
    for name, model_class in (("8bit", Wide8bit), ("rmsprop", WideRMSprop)):
        ckpt = out / f"ckpt-{name}"
        common: dict[str, Any] = dict(shard=shard_net, model_class=model_class)
        results[name] = fit(
            "bf16-mixed",
            "remainder",
            strategy(),
            checkpoint_dir=ckpt,
            extra_callbacks=[GenericAtRest(), StepKind()],
            **common,
        )
        resume = ckpt / "epoch=0.ckpt"
        results[f"{name}_resumed"] = fit(
            "bf16-mixed", "remainder", strategy(), resume_from=resume, extra_callbacks=[StepKind()], **common
        )
        results[f"{name}_from_file"] = _from_file(out / f"file-{name}", common)
    for name, model_class, kernels in (
        ("8bit", Wide8bit, True),
        ("adam8bit", WideAdam8bit, True),
        ("8bit_generic", Wide8bit, False),
        ("rmsprop", WideRMSprop, True),
    ):
        replay = type(f"Replay{name}", (Unclipped, model_class), {})
        with no_kernels(not kernels):
            results[f"{name}_replay"] = fit(
                "bf16-mixed", "remainder", strategy(), inject=False, extra_callbacks=[Replay(), StepKind()],
                shard=shard_net, model_class=replay,
            )  # fmt: skip
    for how in ("reset", "load", "lr"):
        for rebuild in (False, True):
            results[f"8bit_edit_{how}{'_rebuilt' if rebuild else ''}"] = fit(
                "bf16-mixed", "remainder", strategy(), inject=False, shard=shard_net, model_class=Wide8bit,
                extra_callbacks=[Edit8bit(how, rebuild)],
            )  # fmt: skip
    with no_kernels():
        results["8bit_generic_from_file"] = _from_file(
            out / "file-8bit-generic", dict(shard=shard_net, model_class=Wide8bit)
        )
    try:
        fit("bf16-mixed", "remainder", strategy(), shard=shard_net, model_class=WideLocalState)
    except ValueError as error:
        results["local_state"] = {"error": str(error)}
    return results


def _from_file(directory: Path, common: dict[str, Any]) -> dict[str, Any]:
    """A run with whole-file checkpoints (``save_distributed_checkpoint=False``) and the run resumed from its file;
    ``{"error": ..., "steps": ...}`` where it is refused (torchao's quantised state), with the steps it had taken."""
    steps = StepCount()
    whole = strategy(save_distributed_checkpoint=False)
    extra = list(common.pop("extra_callbacks", []))
    try:
        fit("bf16-mixed", "remainder", whole, checkpoint_dir=directory, extra_callbacks=[*extra, steps], **common)
    except ValueError as error:
        return {"error": str(error), "steps": steps.count}
    resume = directory / "epoch=0.ckpt"
    return fit(
        "bf16-mixed", "remainder", strategy(), resume_from=resume, extra_callbacks=[*extra, StepKind()], **common
    )


class StepCount(L.Callback):
    """How many optimizer steps were taken (read after a refusal, which loses the run's record)."""

    def __init__(self) -> None:
        self.count = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.count += 1


class Validated(Net):
    """Shards itself once (a later ``validate`` runs ``configure_model`` again) and has a validation step."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.net, FSDPModule):
            super().configure_model()

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss


def fit_then_validate() -> dict[str, Any]:
    """``trainer.validate`` after ``fit`` with the same trainer: the shards are split again for the forward, and
    restored to the same exact fp32 values after it."""
    model = Validated(shard=shard_net)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    trainer = _trainer(plugin, max_epochs=1, num_sanity_val_steps=0)
    data = loader(GLOBAL_BATCH // 2, int(os.environ["LOCAL_RANK"]), 2)
    trainer.fit(model, data)
    before = {name: _full(param) for name, param in model.named_parameters()}
    metrics = trainer.validate(model, data, verbose=False)
    after = {name: _full(param) for name, param in model.named_parameters()}
    return {"before": before, "after": after, "val_loss": metrics[0]["val_loss"], "weights": after}


def fp8_runs() -> dict[str, Any]:
    """fp8 (emulated) with lean masters: tensorwise all-gathers through a tensor subclass, refused at setup; rowwise
    keeps plain bf16 shards and trains (against fp32 masters, the same recipe)."""
    from tests.distributed.fp8_checks import FP8Net
    from tests.distributed.fp8_checks import _full as full_weight

    results: dict[str, Any] = {}
    for key, recipe, masters in (
        ("tensorwise", "tensorwise", "remainder"),
        ("rowwise", "rowwise", "remainder"),
        ("rowwise_fp32_masters", "rowwise", True),
    ):
        plugin = MixedPrecisionPlugin("bf16-mixed", fp8=recipe, master_weights=masters)
        model = FP8Net(shard=True)
        trainer = _trainer(plugin, max_steps=4)
        try:
            trainer.fit(model)
        except ValueError as error:
            results[key] = {"error": str(error)}
            continue
        weights = {name: full_weight(param) for name, param in model.named_parameters()}
        results[key] = {"losses": model.losses, "weights": weights, "store": type(plugin.masters).__name__}
    return results


def _storage_bytes(tensors: Any) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _staging(masters: Any) -> list[torch.Tensor]:
    return [t for pair in masters.updates.staging._buffers.values() for t in pair]


def main() -> None:
    out = Path(sys.argv[1])
    # torchao's optimizers compile their step: one inductor cache per rank, kept between runs (two ranks writing the
    # same compiled kernel into one cache at once crashed a rank here)
    cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}" / f"rank{os.environ['LOCAL_RANK']}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    ckpt, full_ckpt = out / "ckpt", out / "ckpt-file"
    lean: dict[str, Any] = dict(shard=shard_net, extra_callbacks=[Probe()])
    results = {"full": fit("bf16-mixed", "remainder", strategy=strategy(), checkpoint_dir=ckpt, **lean)}
    results["resumed"] = fit("bf16-mixed", "remainder", strategy=strategy(), resume_from=ckpt / "epoch=0.ckpt", **lean)
    fit(
        "bf16-mixed",
        "remainder",
        strategy=strategy(save_distributed_checkpoint=False),
        checkpoint_dir=full_ckpt,
        **lean,
    )
    results["resumed_from_file"] = fit(
        "bf16-mixed", "remainder", strategy=strategy(), resume_from=full_ckpt / "epoch=0.ckpt", **lean
    )
    results["accumulated"] = fit("bf16-mixed", "remainder", strategy=strategy(), accumulate=2, **lean)
    bf16_sums = {"kind": "remainder", "accumulate_grads_in": "bf16"}
    results["accumulated_bf16"] = fit("bf16-mixed", bf16_sums, strategy=strategy(), accumulate=2, **lean)
    results["fp32_masters"] = fit("bf16-mixed", True, strategy=strategy(), **lean)
    probe = dict(extra_callbacks=[Probe()])
    results["policy"] = fit("bf16-mixed", "remainder", policy=POLICY, strategy=strategy(), shard=shard_with_fp32_head)
    results["norm_in_half"] = fit("bf16-mixed", "remainder", strategy=strategy(), shard=shard_net_whole, **probe)
    for name, model_class in (("replay_adamw", ReplayAdamW), ("replay_sgd", ReplaySGD), ("replay_nadam", ReplayNAdam)):
        results[name] = fit(
            "bf16-mixed",
            "remainder",
            strategy=strategy(),
            inject=False,
            model_class=model_class,
            extra_callbacks=[Replay(), Refollow()],
            shard=shard_net,
        )
    results["rest"] = fit(
        "bf16-mixed",
        "remainder",
        strategy=strategy(),
        model_class=AdamWNet,
        extra_callbacks=[AtRest()],
        shard=shard_net,
    )
    results["generic"] = generic_runs(out)
    results["validated"] = fit_then_validate()
    results["fp8"] = fp8_runs()
    save(results, out, results["full"]["rank"])
    finish()


if __name__ == "__main__":
    main()
