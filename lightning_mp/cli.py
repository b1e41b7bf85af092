"""``python -m lightning_mp fit --config configs/bert.yaml``: LightningCLI that trains with our plugin.

``trainer.precision: 16-mixed | bf16-mixed`` becomes ``MixedPrecisionPlugin`` (Lightning refuses a precision
flag next to a precision plugin, so the CLI takes the flag and builds the plugin); the plugin's other options
live in the ``mixed_precision`` section. ``32-true`` trains with no plugin (the fp32 baseline).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

import lightning_mp.data  # noqa: F401  (registers the sample data modules for short class names)
import lightning_mp.models  # noqa: F401  (registers the sample models for short class names)
from lightning_mp.diagnostics import PrecisionMonitor
from lightning_mp.distributed.strategies import check_strategy_name
from lightning_mp.plugin import MixedPrecisionPlugin

_OURS = {"16-mixed": "16-mixed", "16": "16-mixed", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed"}
_PLUGIN_OPTIONS = ("scaler", "master_weights", "keep_norm_fp32", "policy", "reduce_dtype")
_PLUGIN_DEFAULTS = {
    "scaler": None, "master_weights": False, "keep_norm_fp32": True, "policy": None, "reduce_dtype": "float32",
}


class MixedPrecisionCLI(LightningCLI):
    """LightningCLI whose mixed ``trainer.precision`` values train with :class:`MixedPrecisionPlugin`.

    Any LightningModule / LightningDataModule can be named by ``class_path``; the samples by short name
    (``BertClassifier``, ``ResNetClassifier``, ``SentimentDataModule``, ``ImageDataModule``). Re-running a
    command in the same directory overwrites its saved ``config.yaml``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(
            MixedPrecisionPlugin,
            "mixed_precision",
            skip={"precision"},
            instantiate=False,
            help="Options of the MixedPrecisionPlugin that trainer.precision 16-mixed / bf16-mixed builds",
        )
        parser.add_class_arguments(
            PrecisionMonitor, "precision_monitor", instantiate=False,
            help="PrecisionMonitor: loss scale, skipped steps and where they overflowed, sampled gradient underflow, "
            "the report after fit (--precision_monitor.enabled false turns it off)",
        )
        parser.add_argument("--precision_monitor.enabled", type=bool, default=True, help="Add the PrecisionMonitor")
        parser.add_argument(
            "--test_after_fit", type=bool, default=True,
            help="After fit, run the test loop on the best checkpoint (or the last weights) if the data has a test set",
        )

    def after_fit(self) -> None:
        if not self._get(self.config, "test_after_fit", default=True) or self.trainer.interrupted:
            return
        datamodule = self.datamodule
        if datamodule is None or not _has_test_data(datamodule):
            return
        checkpoint = getattr(self.trainer.checkpoint_callback, "best_model_path", "") or None
        self.trainer.test(self.model, datamodule=datamodule, ckpt_path=checkpoint)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        section = self._get(self.config, "mixed_precision") or {}
        options = {key: _plain(section[key]) for key in _PLUGIN_OPTIONS if key in section}
        config = dict(config)
        plugin = plugin_for(config.get("precision"), config.get("accelerator"), config.get("plugins"), options)
        if str(config.get("precision")) in _OURS:
            config["precision"] = None  # replaced by our plugin, or fp32 where the CPU fallback chose it
        changed = {k: v for k, v in options.items() if v != _PLUGIN_DEFAULTS.get(k)}
        if plugin is None and changed:
            rank_zero_warn(
                f"mixed_precision options {sorted(changed)} are ignored: trainer.precision="
                f"{config.get('precision')!r} does not train with MixedPrecisionPlugin here (use 16-mixed or bf16-mixed)."
            )
        if plugin is not None:
            check_strategy_name(config.get("strategy"))  # issue 11: our error for FSDP1/DeepSpeed, not Lightning's
            plugins = config.get("plugins") or []
            config["plugins"] = [*(plugins if isinstance(plugins, list) else [plugins]), plugin]
            rank_zero_info(f"lightning_mp: training with {plugin!r}")
        monitor = dict(_plain(self._get(self.config, "precision_monitor") or {}))
        if monitor.pop("enabled", True):
            callbacks = [*callbacks, PrecisionMonitor(**monitor)]
        return super()._instantiate_trainer(config, callbacks)


def _plain(value: Any) -> Any:
    """jsonargparse hands a scaler mapping over as a class spec Namespace: back to a plain dict of arguments."""
    init_args = getattr(value, "init_args", None)
    if init_args is not None:
        return init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args)
    return value.as_dict() if hasattr(value, "as_dict") else value


def _has_test_data(datamodule: Any) -> bool:
    # LightningDataModule always defines test_dataloader; the base one raises "not implemented"
    from lightning.pytorch import LightningDataModule

    return type(datamodule).test_dataloader is not LightningDataModule.test_dataloader


def plugin_for(
    precision: Optional[str], accelerator: Optional[str], plugins: Any, options: dict[str, Any]
) -> Optional[MixedPrecisionPlugin]:
    """The plugin that ``trainer.precision`` asks for, or ``None`` (fp32 and other precisions pass through).

    Raises:
        ValueError: a mixed ``precision`` together with a precision plugin in ``trainer.plugins``.
    """
    precision = None if precision is None else str(precision)
    if precision not in _OURS:
        return None
    plugin_list = plugins if isinstance(plugins, list) else [plugins] if plugins is not None else []
    given = [type(p).__name__ for p in plugin_list if isinstance(p, Precision)]
    if given:
        raise ValueError(
            f"trainer.precision={precision!r} and a precision plugin in trainer.plugins ({', '.join(given)}) were "
            "both given: Lightning accepts only one. Drop trainer.precision to use the plugin as configured, or "
            "drop the plugin and set its options under mixed_precision."
        )
    resolved = _OURS[precision]
    if resolved == "16-mixed" and _runs_on_cpu(accelerator):
        resolved = cpu_fallback()
        if resolved is None:
            return None
    return MixedPrecisionPlugin(resolved, **{k: v for k, v in options.items() if resolved == "16-mixed" or k != "scaler"})


def _runs_on_cpu(accelerator: Optional[str]) -> bool:
    name = str(accelerator or "auto").lower()
    if name == "cpu":
        return True
    if name in ("auto", "gpu", "cuda"):
        return not torch.cuda.is_available() and not (name == "auto" and torch.backends.mps.is_available())
    return False


def cpu_fallback() -> Optional[str]:
    """``16-mixed`` on a CPU-only machine: bf16 (Lightning's convention) where the CPU has native bf16, else fp32.

    fp16 and bf16 matmuls on CPUs without AVX512-BF16 or AMX run on fallback kernels far slower than fp32
    (measured on a Zen 3 CPU: 20x slower forward, ~200x slower input gradient; see benchmarks/RESULTS.md), so
    there we train in fp32 and say so. An explicit ``MixedPrecisionPlugin`` in ``trainer.plugins`` is honoured
    as given, fp16 included.
    """
    if cpu_has_native_bf16():
        rank_zero_warn(
            "trainer.precision='16-mixed' on a machine without a GPU: training in bf16-mixed instead, as Lightning "
            "does (fp16 on CPU is slow). For real fp16, put MixedPrecisionPlugin in trainer.plugins."
        )
        return "bf16-mixed"
    rank_zero_warn(
        "trainer.precision='16-mixed' on a machine without a GPU, and this CPU has no native bf16 (no AVX512-BF16 "
        "or AMX): bf16 and fp16 would be many times slower than fp32 here, so training in fp32 (32-true). Set "
        "trainer.precision=bf16-mixed, or put MixedPrecisionPlugin in trainer.plugins, to force half precision."
    )
    return None


def cpu_has_native_bf16() -> bool:
    """Whether the CPU has bf16 matmul instructions (x86: AVX512-BF16 or AMX-BF16; Arm: BF16)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return True  # not Linux: assume Lightning's convention holds
    flags = set()
    for line in cpuinfo.read_text(errors="ignore").splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of ``python -m lightning_mp``."""
    MixedPrecisionCLI(args=args if args is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
