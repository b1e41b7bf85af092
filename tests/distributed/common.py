"""The model, data and recorder shared by the 2-rank scripts and their single-process references."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from lightning_mp.master.lean.generic import leaves_of

SAMPLES = 32  # global batch 8: 4 optimizer steps per epoch, 2 epochs
GLOBAL_BATCH = 8
EPOCHS = 2
INJECT_AT = 2  # the optimizer step whose gradient gets an inf on rank 0 only
CLIP = 0.3  # gradient norm clip (the gradients' norm is above it for most steps: recorded and asserted)


def loader(batch_size: int, rank: int = 0, world_size: int = 1) -> DataLoader:
    """The same 32 samples in order; with ``world_size > 1`` rank ``r`` reads samples ``r, r + world_size, ...``, so
    that the ranks' batches of one step together are the single-process batch of that step (Lightning's own
    distributed sampler shuffles training data)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(SAMPLES, 1, generator=gen)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def sum_loader(world_size: int, rank: int) -> DataLoader:
    """The step-inside-backward scripts' data: 64 samples of 16 features, target their sum, batch 8 per rank; rank
    ``r`` reads samples ``r, r + world_size, ...`` (no shuffle)."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(x, x.sum(1, keepdim=True))
    return DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, world_size, rank, shuffle=False))


def assert_same_bits(
    ours: dict[str, Any], reference: dict[str, Any], weights: str = "state_dict", steps: str = "global_step"
) -> None:
    """Two 2-rank runs of the step inside backward saved the same fp32 weights (``ours[weights]``) and optimizer state
    (``ours["optimizer_state"]``), bit for bit, after 4 steps (``ours[steps]``)."""
    assert ours[weights].keys() == reference[weights].keys() and reference[weights]
    for name, value in reference[weights].items():
        assert value.dtype == torch.float32 and torch.equal(ours[weights][name], value), name
    assert ours["optimizer_state"].keys() == reference["optimizer_state"].keys() and reference["optimizer_state"]
    for index, state in reference["optimizer_state"].items():
        assert state and ours["optimizer_state"][index].keys() == state.keys(), index
        for key, value in state.items():  # a tensor subclass (torchao's 8-bit state): its inner tensors
            mine, theirs = leaves_of(ours["optimizer_state"][index][key]), leaves_of(value)
            assert len(mine) == len(theirs) and all(map(torch.equal, mine, theirs)), (index, key)
    assert ours[steps] == reference[steps] == 4


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), a plain tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().float().clone()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class Net(L.LightningModule):
    """Linear -> LayerNorm -> Tanh -> Linear, MSE; SGD with momentum; an inf on rank 0 at step INJECT_AT.

    ``shard``: a function ``(module, plugin) -> None`` that applies FSDP2 in ``configure_model``.
    """

    # the user's side of FSDP2: the LayerNorm on its own (the plugin keeps norms in fp32), then the whole net

    def __init__(
        self,
        inject: bool = True,
        shard: Any = None,
        inject_rank: int = 0,
        inject_every: bool = False,
        per_rank_batch: int = GLOBAL_BATCH,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.fused = fused  # SGD(fused=True): the step is skipped on the device (lightning_mp.stepping)
        self.per_rank_batch = per_rank_batch
        self.net = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))
        self.inject = inject
        self.inject_rank = inject_rank
        self.inject_every = inject_every
        self.shard = shard
        self.record: dict[str, Any] = {"norms": [], "clipped": [], "steps": [], "local_grads": None, "grads": None}

        self.net[0].register_forward_pre_hook(self._record_compute_dtype)
        self.net[3].register_forward_hook(self._record_head_dtypes)

    def _record_compute_dtype(self, module: nn.Module, args: Any) -> None:
        # the dtype the first layer's weight has while it computes: half with master weights (our half model, or
        # FSDP2's all-gathered parameters), fp32 without
        self.record.setdefault("param_dtype", module.weight.dtype)

    def _record_head_dtypes(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.record.setdefault("head_dtypes", (module.weight.dtype, output.dtype))

    def train_dataloader(self) -> DataLoader:
        # built in each process (ddp_spawn starts them after fit() is called), for this rank
        return loader(self.per_rank_batch, self.global_rank, self.trainer.world_size)

    def configure_model(self) -> None:
        if self.shard is not None:
            self.shard(self, self.trainer.precision_plugin)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        weight = self.net[0].weight
        if self.trainer.global_step == 0 and self.record["local_grads"] is None:
            # what this rank's backward produced, before any reduction we do (DDP with masters) or FSDP2's
            self.record["local_grads"] = _local(weight.grad).detach().float().clone()
        at_step = self.inject_every or self.trainer.global_step == INJECT_AT
        if self.inject and at_step and self.global_rank == self.inject_rank:
            _local(weight.grad)[0, 0] = float("inf")

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Optional[str] = None
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.trainer.global_step == 0:
            self.record["grads"] = _full(params[0].grad)  # the (unscaled, reduced) gradient the optimizer sees
            self.record["grad_dtype"] = params[0].grad.dtype
        self.record["norms"].append(float(_full(torch.nn.utils.get_total_norm([p.grad for p in params]))))
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.record["clipped"].append(float(_full(torch.nn.utils.get_total_norm([p.grad for p in params]))))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, fused=self.fused)


class Adam8bitNet(Net):
    """``Net`` 1024 wide under torchao's ``AdamW8bit``: the first weight (4096 values) keeps 8-bit moments, the rest
    fp32 ones (fewer than 4096 values), as torchao makes them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(4, 1024), nn.LayerNorm(1024), nn.Tanh(), nn.Linear(1024, 1))
        self.net[0].register_forward_pre_hook(self._record_compute_dtype)
        self.net[3].register_forward_hook(self._record_head_dtypes)

    def configure_optimizers(self) -> Any:
        from torchao.optim import AdamW8bit

        return AdamW8bit(self.parameters(), lr=1e-2, weight_decay=0.1)


class ManualNet(Net):
    """``Net`` with manual optimization: ``accumulate`` micro-batches per step, as Lightning's manual-optimization
    docs write it (under DDP every backward synchronises: no ``no_sync``), clipping by norm before ``opt.step()``."""

    def __init__(self, accumulate: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.accumulate = accumulate

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0 or batch_idx + 1 == self.trainer.num_training_batches:
            self.configure_gradient_clipping(optimizer, CLIP, "norm")
            optimizer.step()
            optimizer.zero_grad()
        return loss


class EndSpawnedRanksTogether(Callback):
    """strategy='ddp_spawn' on gloo: both spawned ranks meet and take the process group down at the end of fit.

    Lightning leaves a gloo group to the interpreter's exit; rank 0 (which hosts the rendezvous store) can then exit
    while rank 1 is still tearing its group down, and rank 1 aborts ("terminate called without an active
    exception", SIGABRT; seen once in CI under load, reproduced here 1 in 4 runs with the CPUs busy). Nothing
    collective runs after the teardown hook in a spawned rank (rank 0 only saves the weights and returns them)."""

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        finish()


class StepRecorder(Callback):
    """After every batch: (global step, loss scale, skipped steps so far)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Net, *args: Any) -> None:
        scaler = trainer.precision_plugin.scaler
        pl_module.record["steps"].append((trainer.global_step, scaler.scale, scaler.skipped_steps))


def shard_net(module: Net, plugin: MixedPrecisionPlugin) -> None:
    """What a user writes in ``configure_model``: the norm on its own with its policy, then the network."""
    from torch.distributed.fsdp import fully_shard

    mesh = module.device_mesh["data_parallel"]
    fully_shard(module.net[1], mesh=mesh, mp_policy=plugin.fsdp2_policy("net.1", module.net[1]))
    fully_shard(module.net, mesh=mesh, mp_policy=plugin.fsdp2_policy())


def make_plugin(
    precision: str,
    masters: Any,
    reduce_dtype: str = "float32",
    scaler: Optional[DynamicLossScaler] = None,
    policy: Any = None,
) -> MixedPrecisionPlugin:
    if scaler is None and precision == "16-mixed":
        scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    return MixedPrecisionPlugin(
        precision, scaler=scaler, master_weights=masters, reduce_dtype=reduce_dtype, policy=policy
    )


def fit(
    precision: str,
    masters: Any,
    strategy: Any = "ddp",
    devices: int = 2,
    accumulate: int = 1,
    reduce_dtype: str = "float32",
    checkpoint_dir: Optional[Path] = None,
    resume_from: Optional[Path] = None,
    inject: bool = True,
    shard: Any = None,
    scaler: Optional[DynamicLossScaler] = None,
    policy: Any = None,
    accelerator: str = "cpu",
    extra_callbacks: Sequence[Callback] = (),
    model_class: type = Net,
    **model_kwargs: Any,
) -> dict[str, Any]:
    """One run; what it recorded, the final fp32 weights (whole, on every rank) and the scaler state."""
    torch.manual_seed(0)
    manual = issubclass(model_class, ManualNet)  # it accumulates and clips itself (Lightning refuses both then)
    if manual:
        model_kwargs["accumulate"] = accumulate
    model = model_class(
        inject=inject, shard=shard, per_rank_batch=GLOBAL_BATCH // devices // accumulate, **model_kwargs
    )
    plugin = make_plugin(precision, masters, reduce_dtype, scaler, policy)
    callbacks: list[Callback] = [StepRecorder(), *extra_callbacks]
    if strategy == "ddp_spawn":
        callbacks.append(EndSpawnedRanksTogether())
    if checkpoint_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=checkpoint_dir,
                filename="{epoch}",
                save_top_k=-1,
                every_n_epochs=1,
                save_on_train_epoch_end=True,
            )
        )
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        plugins=[plugin],
        max_epochs=EPOCHS,
        accumulate_grad_batches=1 if manual else accumulate,
        gradient_clip_val=None if manual else CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpoint_dir is not None,
        callbacks=callbacks,
        deterministic=True,
        use_distributed_sampler=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=resume_from)
    model.record["warnings"] = sorted({str(w.message) for w in caught})
    weights = {name: _full(param).cpu() for name, param in model.named_parameters()}
    model.record["plugin_pickles"] = (
        pickle.loads(pickle.dumps(plugin)).scaler.state_dict() == plugin.scaler.state_dict()
    )
    return {**model.record, "weights": weights, "scaler": plugin.scaler.state_dict(), "rank": trainer.global_rank}


def save(results: Any, out: Path, rank: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.save(results, out / f"rank{rank}.pt")


def finish() -> None:
    """Both ranks done before either tears the process group down (an exit mid-collective can abort the other)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def load_ranks(out: Path, ranks: Sequence[int] = (0, 1)) -> list[Any]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in ranks]
