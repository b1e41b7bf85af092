"""``python -m lightning_mp fit --config configs/bert.yaml``: LightningCLI that trains with our plugin.

``trainer.precision: 16-mixed | bf16-mixed`` becomes ``MixedPrecisionPlugin`` (Lightning refuses a precision
flag next to a precision plugin, so the CLI takes the flag and builds the plugin); the plugin's other options
live in the ``mixed_precision`` section. ``32-true`` trains with no plugin (the fp32 baseline).
"""

from __future__ import annotations

import os
import sys
from argparse import ArgumentError
from typing import Any, Optional

from jsonargparse import class_from_function
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

import lightning_mp.samples  # noqa: F401  (registers the sample models and data modules for short class names)
from lightning_mp.cli import consolidate
from lightning_mp.cli.checks import (
    SPECIAL_CKPT_PATHS,
    CLIConfigError,
    check_checkpoint_class,
    check_checkpoint_file,
    check_checkpoint_weights,
    check_dependencies,
    check_monitor_options,
    check_plugin_specs,
    check_strategy,
    class_spec,
)
from lightning_mp.cli.choice import (
    OUR_PRECISIONS,
    PLUGIN_DEFAULTS,
    PLUGIN_OPTIONS,
    PrecisionChoice,
    choose_precision,
    has_our_plugin,
    plain_arguments,
)
from lightning_mp.cli.errors import explain_parse_error, missing_extra, one_line
from lightning_mp.cli.report import StepsThisRun, effective_config_yaml, fit_summary, pop_print_config
from lightning_mp.cli.run_folder import NoEmptyRunFolder
from lightning_mp.diagnostics import PrecisionMonitor
from lightning_mp.distributed.strategies import end_distributed_run
from lightning_mp.plugin import MixedPrecisionPlugin
from lightning_mp.samples.resources import SourceUnavailableError
from lightning_mp.standalone import trainer_callbacks

#: every subcommand of ``python -m lightning_mp``, in the order ``--help`` lists them, with its one line there
#: (Lightning's own lines are the first line of each Trainer method's docstring, cut mid-sentence for two of them)
SUBCOMMANDS = {
    "fit": "Train the model (then test it on the best checkpoint, where the data has a test set).",
    "validate": "One evaluation epoch over the validation set.",
    "test": "One evaluation epoch over the test set.",
    "predict": "The model's predictions over the predict set.",
    "consolidate": "A checkpoint (an FSDP2 distributed checkpoint folder or a .ckpt file) as one fp32 state dict.",
}


def program_name() -> str:
    """How the command was started, as its usage lines say it: ``lightning-mp`` (the script pip installs), or
    ``python -m lightning_mp`` (also what a call of :func:`main` from Python is named)."""
    return "lightning-mp" if os.path.basename(sys.argv[0] if sys.argv else "") == "lightning-mp" else PROG


PROG = "python -m lightning_mp"
DESCRIPTION = (
    "Train, validate, test or predict with any LightningModule from a YAML config, trainer.precision 16-mixed or "
    "bf16-mixed running lightning_mp's MixedPrecisionPlugin (its options: --mixed_precision.*); consolidate a "
    "checkpoint into one fp32 state dict."
)


class MixedPrecisionCLI(LightningCLI):
    """LightningCLI whose mixed ``trainer.precision`` values train with :class:`MixedPrecisionPlugin`.

    Any LightningModule / LightningDataModule can be named by ``class_path``; the samples by short name
    (``BertClassifier``, ``ResNetClassifier``, ``SentimentDataModule``, ``ImageDataModule``). Re-running a
    command in the same directory overwrites its saved ``config.yaml``. Configuration errors found before any work
    (parse errors, plugin and monitor options, ``trainer.plugins``, the strategy, a ``--ckpt_path`` that cannot be
    loaded or is of another model) raise :class:`CLIConfigError` with a one-line message; every ``fit`` ends with a
    one-paragraph summary (:func:`lightning_mp.cli.report.fit_summary`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        self.precision_choice: Optional[PrecisionChoice] = None
        self.tested_on: Optional[str] = None
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
            PrecisionMonitor,
            "precision_monitor",
            instantiate=False,
            help="PrecisionMonitor: loss scale, skipped steps and where they overflowed, sampled gradient underflow, "
            "the report after fit (--precision_monitor.enabled false turns it off)",
        )
        parser.add_argument("--precision_monitor.enabled", type=bool, default=True, help="Add the PrecisionMonitor")
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help="After fit, run the test loop on the best checkpoint (or the last weights) if the data has a test set",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, then check what can be checked before any work; ``--print_config`` prints what will train."""
        args, print_flags = pop_print_config(args)
        try:
            if print_flags is None:
                super().parse_arguments(parser, args)
            else:
                self.config = parser.parse_args(args)  # our own print: the parser's would show the flag, not the plugin
        except ArgumentError as err:  # the parsers do not exit (init_parser): the error is said in one line here
            raise CLIConfigError(explain_parse_error(str(err)) or str(err)) from err
        self.subcommand = self.config.get("subcommand")  # what self._get needs; LightningCLI sets it again after
        for key in ("model", "data"):  # a missing package first, before any other line: nothing else can run without
            check_dependencies(key, self._get(self.config, key))
        trainer = self._get(self.config, "trainer") or {}
        check_plugin_specs(trainer.get("plugins"))
        choice = self.precision_choice = choose_precision(
            trainer.get("precision"), trainer.get("accelerator"), trainer.get("plugins"), self._plugin_options()
        )
        if choice.plugin is not None or has_our_plugin(trainer.get("plugins")):
            asked = f"trainer.precision={choice.requested!r}" if choice.plugin is not None else "trainer.plugins"
            check_strategy(trainer.get("strategy"), asked)
        check_monitor_options({k: v for k, v in self._monitor_options().items() if k != "enabled"})
        if self.subcommand:
            model = class_spec(self._get(self.config, "model"))
            ckpt_path = self.config[self.subcommand].get("ckpt_path")
            scaler = choice.plugin.scaler if choice.plugin is not None else None
            check_checkpoint_file(ckpt_path, scaler.state_dict() if scaler is not None else None)
            differ = check_checkpoint_class(ckpt_path, *(model if model else (None, None)))
            if differ:  # LightningCLI builds the model with the checkpoint's settings: say so
                shown = ", ".join(f"{key}={saved!r} (config: {given!r})" for key, (saved, given) in differ.items())
                rank_zero_info(f"lightning_mp: the model is built with the settings saved in {ckpt_path}: {shown}.")
        if print_flags is not None:
            dumped = parser.dump(self.config, skip_link_targets=False, skip_none=False, format="yaml")
            print(
                effective_config_yaml(
                    dumped,
                    self.subcommand,
                    self.precision_choice,
                    PLUGIN_DEFAULTS,
                    skip_none="skip_null" in print_flags,
                )
            )
            sys.exit(0)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("exit_on_error", False)  # parse errors come back to parse_arguments, to be said plainly
        kwargs.setdefault("prog", program_name())  # not "__main__.py"; a subcommand's parser gets its own name
        kwargs.setdefault("description", DESCRIPTION)  # a subcommand's parser gets its own line of SUBCOMMANDS
        return super().init_parser(**kwargs)

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """Lightning's Trainer subcommands, each with its whole line of :data:`SUBCOMMANDS`, then ``consolidate``,
        which :func:`main` runs before any CLI is built: listed here so that ``--help`` names every subcommand."""
        self._subcommand_parsers: dict[str, LightningArgumentParser] = {}
        subcommands = parser.add_subcommands()
        trainer_class = (
            self.trainer_class if isinstance(self.trainer_class, type) else class_from_function(self.trainer_class)
        )
        for name in self.subcommands():
            options = {"description": SUBCOMMANDS.get(name), **kwargs.get(name, {})}
            self._subcommand_parsers[name] = self._prepare_subcommand_parser(trainer_class, name, **options)
            subcommands.add_subcommand(name, self._subcommand_parsers[name], help=SUBCOMMANDS.get(name))
        subcommands.add_subcommand(
            "consolidate", consolidate.parser(f"{parser.prog} consolidate"), help=SUBCOMMANDS["consolidate"]
        )

    def _monitor_options(self) -> dict[str, Any]:
        return dict(plain_arguments(self._get(self.config, "precision_monitor") or {}))

    def _plugin_options(self) -> dict[str, Any]:
        section = self._get(self.config, "mixed_precision") or {}
        return {key: plain_arguments(section[key]) for key in PLUGIN_OPTIONS if key in section}

    def _check_ckpt_path(self) -> None:
        # after the model is built, before the Trainer does any work with the checkpoint
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path") if self.subcommand else None
        if ckpt_path is not None and ckpt_path not in SPECIAL_CKPT_PATHS:
            check_checkpoint_weights(ckpt_path, self.model)

    def before_fit(self) -> None:
        self._check_ckpt_path()

    def before_validate(self) -> None:
        self._check_ckpt_path()

    def before_test(self) -> None:
        self._check_ckpt_path()

    def before_predict(self) -> None:
        self._check_ckpt_path()

    def after_fit(self) -> None:
        self.tested_on = None
        if self._get(self.config, "test_after_fit", default=True) and not self.trainer.interrupted:
            self._test_after_fit()
        choice = self.precision_choice
        rank_zero_info(
            fit_summary(
                self.trainer, choice.describe("Trained") if choice else "", self.tested_on, self.summary_extras()
            )
        )

    def summary_extras(self) -> list[str]:
        """More sentences for the end-of-fit summary: where the precision report was written."""
        extras = []
        for callback in trainer_callbacks(self.trainer):
            files = getattr(callback, "report_files", None) if isinstance(callback, PrecisionMonitor) else None
            if files is not None:
                figure = f" and {files.png}" if files.png is not None else f" (no figure: {files.png_error})"
                extras.append(
                    f"The precision report (loss scale, skipped steps, gradient statistics, and what to "
                    f"change) is {files.markdown}{figure}"
                )
        return extras

    def _test_after_fit(self) -> None:
        datamodule = self.datamodule
        if datamodule is None or not _has_test_data(datamodule):
            return
        best = [
            path
            for cb in self.trainer.checkpoint_callbacks
            if getattr(cb, "monitor", None) and (path := getattr(cb, "best_model_path", ""))
        ]
        checkpoint = best[0] if best else None
        self.trainer.test(self.model, datamodule=datamodule, ckpt_path=checkpoint)
        self.tested_on = f"the best checkpoint {checkpoint}" if checkpoint else "the final weights"

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        choice = self.precision_choice or choose_precision(
            config.get("precision"), config.get("accelerator"), config.get("plugins"), self._plugin_options()
        )
        config = dict(config)
        if str(config.get("precision")) in OUR_PRECISIONS:
            config["precision"] = None  # replaced by our plugin, or fp32 where the CPU fallback chose it
        if choice.warning:
            rank_zero_warn(choice.warning)
        plugin = choice.plugin
        if plugin is not None:  # the strategy was checked in parse_arguments
            plugins = config.get("plugins") or []
            config["plugins"] = [*(plugins if isinstance(plugins, list) else [plugins]), plugin]
        reason = "" if choice.warning else f": {choice.reason}"  # the warning gave the reason already
        rank_zero_info(f"lightning_mp: {choice.what('running', full=True)}{reason}")
        monitor = self._monitor_options()
        if monitor.pop("enabled", True):
            callbacks = [*callbacks, PrecisionMonitor(**monitor)]
        run_folder = NoEmptyRunFolder()
        trainer = super()._instantiate_trainer(config, [*callbacks, StepsThisRun(), run_folder])
        run_folder.watch(trainer)  # the run's folders, before the Trainer creates any
        return trainer


# ------------------------------------------------------------------------------------ trainer.precision


def _has_test_data(datamodule: Any) -> bool:
    # LightningDataModule always defines test_dataloader; the base one raises "not implemented"
    from lightning.pytorch import LightningDataModule

    return type(datamodule).test_dataloader is not LightningDataModule.test_dataloader


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of ``python -m lightning_mp`` (``args``: the command line without the program name; ``None``
    reads ``sys.argv``). A configuration error, a missing sample source or a missing optional package (with the extra
    that installs it) is printed alone, exit status 2.
    ``consolidate CHECKPOINT OUT.pt`` runs :func:`lightning_mp.cli.consolidate.main` (one fp32 state dict)."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "consolidate":  # not a Trainer method like fit/test: its own small command
        return consolidate.main(list(argv[1:]), prog=f"{program_name()} consolidate")
    try:
        cli = MixedPrecisionCLI(args=args)
    except (CLIConfigError, SourceUnavailableError) as err:
        print(f"lightning_mp: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    except ArgumentError as err:  # LightningCLI re-parsing the hyperparameters saved in --ckpt_path
        print(
            f"lightning_mp: error: the settings saved in --ckpt_path do not parse: {one_line(str(err))}",
            file=sys.stderr,
        )
        raise SystemExit(2) from err
    except (ValueError, ImportError) as err:  # jsonargparse wraps errors raised while it builds the model or data
        cause = _cause_of_type(err, SourceUnavailableError)
        line = str(cause) if cause is not None else missing_extra(err)  # an optional package that is not installed
        if line is None:
            raise
        print(f"lightning_mp: error: {line}", file=sys.stderr)
        raise SystemExit(2) from err
    end_distributed_run(getattr(cli, "trainer", None))


def _cause_of_type(err: BaseException, kind: type) -> Optional[BaseException]:
    seen = set()
    link: Optional[BaseException] = err
    while link is not None and id(link) not in seen:
        if isinstance(link, kind):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


if __name__ == "__main__":
    main()
