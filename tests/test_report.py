"""The run report: Markdown + PNG from a saved history, from a Trainer, after a short CLI fit; without matplotlib
the Markdown is still written and says how to get the figure."""

import math
import sys
from pathlib import Path

import pytest

from lightning_mp.cli import main
from lightning_mp.diagnostics import LayerSample, OverflowRecord, PrecisionMonitor, RunHistory, report
from lightning_mp.diagnostics.history import HISTORY_FILE
from tests.helpers import TinyRegressor
from tests.planted import Planted, PlantedModel, fit_planted
from tests.test_cli import CONFIGS, _short


def _history():
    samples = [
        LayerSample(
            step,
            1024.0,
            "param_grads",
            ["a", "b"],
            [[100.0, 1.0, 2.0, 3.0, 0.0, 10.0], [50.0, 0.0, 0.0, 0.0, 1.0, math.inf]],
        )
        for step in (0, 10, 20)
    ]
    record = OverflowRecord(
        step=12,
        scale_before=2048.0,
        scale_after=1024.0,
        cause="half_precision",
        phase="forward",
        module="b",
        module_class="Linear",
        op="addmm",
        input_amax=3.5,
        nonfinite_params=["b.weight"],
        replays=2,
        seconds=0.01,
    )
    return RunHistory(
        precision="fp16",
        scaler={"scale": 2048.0, "growth_interval": 2000, "hysteresis": 1},
        steps=25,
        scale_changes=[(0, 2048.0), (13, 1024.0)],
        skipped=[12],
        overflows=[record],
        samples=samples,
        sample_every=10,
    )


def test_history_round_trips_through_json_with_infinite_values(tmp_path):
    history = _history()
    path = history.save(tmp_path)
    assert path.name == HISTORY_FILE
    assert RunHistory.load(tmp_path) == history
    assert RunHistory.load(path).samples[0].headroom()[1] == -math.inf


def test_report_of_a_saved_history_writes_markdown_with_the_overflow_and_layers_and_a_png(tmp_path):
    _history().save(tmp_path)
    files = report(tmp_path)
    text = files.markdown.read_text()
    assert "fp16 run: 25 optimizer steps, 1 skipped (4.0%)" in text
    assert "Loss scale 2^11 at the start, 2^10 at the end" in text
    assert "| b (Linear), forward, op addmm | half_precision | 1 | 12 | 12 | 3.5 |" in text
    assert "| 12 | 2^11 -> 2^10 | b (Linear), forward, op addmm | half_precision | b.weight | 2 | 0.010 |" in text
    assert "| a | 100 | 1.00% | 2.00% | 3.00% | 10 | 12.7 |" in text  # log2(65504 / 10) = 12.68
    assert "| b | 50 | 0.00% | 0.00% | 0.00% | inf | overflow |" in text
    assert f"![loss scale and per-layer gradient statistics]({files.png.name})" in text
    matplotlib_image = pytest.importorskip("matplotlib.image")
    height, width, _ = matplotlib_image.imread(files.png).shape
    assert (width, height) == (1100, 940)  # three panels: the scale, underflow and headroom


def test_report_without_matplotlib_still_writes_the_markdown_and_says_how_to_get_the_figure(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    _history().save(tmp_path)
    files = report(tmp_path / HISTORY_FILE)
    assert files.png is None and 'pip install "lightning_mp[diagnostics]"' in files.png_error
    assert "(No figure: The precision report's PNG needs matplotlib" in files.markdown.read_text()


def test_report_of_a_trainer_uses_its_monitor_and_a_missing_history_is_a_clear_error(tmp_path):
    monitor = PrecisionMonitor(sample_every=2, report=False)
    trainer, _ = fit_planted(
        PlantedModel(Planted("forward", at=1)), monitor=monitor, steps=3, default_root_dir=tmp_path
    )
    assert not (tmp_path / "precision_report.md").exists()  # report=False: nothing written after fit
    files = report(trainer, out_dir=tmp_path / "out")
    assert "net.3 (Planted), forward, op mul" in files.markdown.read_text()
    with pytest.raises(FileNotFoundError, match="No precision diagnostics at .*: pass a run's log directory"):
        report(tmp_path / "nowhere")


def test_a_short_cli_fit_writes_the_report_into_the_log_dir_and_enabled_false_turns_it_off(tmp_path):
    fp16 = [
        "--trainer.precision=null",
        "--trainer.plugins=lightning_mp.MixedPrecisionPlugin",
        "--trainer.plugins.precision=16-mixed",
        "--trainer.plugins.scaler={init_scale: 2.0e+9, max_scale: 2.0e+9}",
        "--model=tests.helpers.DigitsMLP",
        "--model.hidden=8",
        "--test_after_fit=false",
    ]
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "digits.yaml"),
            *_short(tmp_path / "on", *fp16, steps=4),
            "--precision_monitor.sample_every=2",
        ]
    )
    run_dir = next((tmp_path / "on").rglob(HISTORY_FILE)).parent
    assert (run_dir / "precision_report.md").is_file() and (run_dir / "precision_report.png").is_file()
    history = RunHistory.load(run_dir)
    assert history.skipped and history.overflows[0].cause == "loss_scale"  # 2e9 overflows the scaled gradients
    assert [s.step for s in history.samples] == [0, 2]
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "digits.yaml"),
            *_short(tmp_path / "off", *fp16, steps=1),
            "--precision_monitor.enabled=false",
        ]
    )
    assert not list((tmp_path / "off").rglob(HISTORY_FILE))


def test_a_run_that_dies_at_max_consecutive_skips_still_writes_its_report_with_the_error(tmp_path):
    from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
    from tests.helpers import make_trainer, regression_loader

    planted = Planted("log", at=0)
    model = PlantedModel(planted)
    planted.step = lambda: (0 if model.trainer.global_step < 3 else -1, -1)  # NaN from the model at steps 0, 1, 2
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0, max_consecutive_skips=3))
    trainer = make_trainer(plugin, callbacks=[PrecisionMonitor(sample_every=0)], max_steps=6, default_root_dir=tmp_path)
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row"):
        trainer.fit(model, regression_loader())
    text = (tmp_path / "precision_report.md").read_text()
    assert "**The run ended with an error:**\n\n```text\nFloatingPointError: 3 optimizer steps in a row" in text
    assert "1. **bf16**" in text and "2. **model**" in text  # the model rule names log in net.3
    assert "| net.3 (Planted), forward, op log | model | 3 | 0 | 2 |" in text
    assert (tmp_path / "precision_report.png").is_file()


#: the shape of a HalfPrecisionError's message: longer than a line, a policy line at its end that must stay whole
LONG_ERROR = (
    "encoder.layers.0.attention (Attention) writes -1e+09 into a float16 tensor (op masked_fill at model.py:42), "
    "beyond float16's range (largest 65504), which the user's own check in training_step reports at length. "
    "Fix: keep it in fp32 with MixedPrecisionPlugin(policy=CastPolicy(fp32_ops=('masked_fill',)))\n"
    "A second line of the error, with a `backtick` and ``` three of them in it."
)


class _CrashingRegressor(TinyRegressor):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 1:
            raise RuntimeError(LONG_ERROR)
        return super().training_step(batch, batch_idx)


def test_a_crashed_run_report_header_wraps_the_whole_error_never_cuts_it(tmp_path):
    from lightning_mp import MixedPrecisionPlugin
    from lightning_mp.diagnostics.run_report import ERROR_WIDTH
    from tests.helpers import make_trainer, regression_loader

    monitor = PrecisionMonitor(sample_every=0)
    trainer = make_trainer(
        MixedPrecisionPlugin("bf16-mixed"), callbacks=[monitor], max_steps=3, default_root_dir=tmp_path
    )
    with pytest.raises(RuntimeError, match="the user's own check"):
        trainer.fit(_CrashingRegressor(), regression_loader())
    text = (tmp_path / "precision_report.md").read_text()
    header = text.split("## Advice")[0]
    block = header.split("**The run ended with an error:**\n\n````text\n", 1)[1].split("\n````\n", 1)[0]
    lines = block.splitlines()
    assert " ".join(block.split()) == " ".join(f"RuntimeError: {LONG_ERROR}".split())  # every word, in order
    assert len(lines) > 3 and all(len(line) <= ERROR_WIDTH or " " not in line.strip() for line in lines)
    assert "MixedPrecisionPlugin(policy=CastPolicy(fp32_ops=('masked_fill',)))" in lines[3]  # the fix kept whole
    assert lines[-1].startswith("A second line")  # the error's own lines stay lines; wrapped ones are indented
    assert all(line.startswith("  ") for line in lines[1:-1])


def test_a_bf16_run_report_speaks_of_bf16_not_of_fp16_or_a_loss_scale(tmp_path):
    from lightning_mp import MixedPrecisionPlugin, PrecisionMonitor
    from lightning_mp.diagnostics.run_report import render_markdown
    from tests.helpers import TinyRegressor, make_trainer, regression_loader

    monitor = PrecisionMonitor(sample_every=1, report=False)
    make_trainer(MixedPrecisionPlugin("bf16-mixed"), callbacks=[monitor], max_steps=2, default_root_dir=tmp_path).fit(
        TinyRegressor(), regression_loader()
    )
    text = render_markdown(monitor.history, png_error="(not drawn)")
    assert text.startswith("# Mixed-precision report\n\nbf16 run: 2 optimizer steps, 0 skipped")
    layers = monitor.history.samples[-1].layers
    assert (
        f"At the last sample (step 1, bf16), the {len(layers)} layers with the largest share of zero gradient" in text
    )
    assert _table_rows(text, "## Gradient underflow") == len(layers)  # the header counts the rows below it
    assert "fp16" not in text.split("## Causes")[0] and "2^0" not in text  # the legend lists every cause


def _table_rows(text: str, section: str) -> int:
    """The rows of the first table in ``section`` (header and separator not counted)."""
    lines = text.split(section, 1)[1].split("\n## ", 1)[0].splitlines()
    table = [line for line in lines if line.startswith("|")]
    return len(table) - 2


@pytest.mark.parametrize("count", [1, 9, 10, 11])
def test_the_layers_header_counts_the_rows_it_heads(count):
    from lightning_mp.diagnostics.run_report import render_markdown

    layers = [f"layer{i}" for i in range(count)]
    sample = LayerSample(0, 1024.0, "param_grads", layers, [[100.0, 1.0, 2.0, 3.0, 0.0, 10.0]] * count)
    text = render_markdown(RunHistory(precision="fp16", steps=1, samples=[sample], sample_every=1), "(not drawn)")
    rows = _table_rows(text, "## Gradient underflow")
    assert rows == min(count, 10)
    expected = {1: "the layer with", 9: "the 9 layers with", 10: "the 10 layers with", 11: "the 10 of 11 layers with"}
    assert expected[count] in text


def test_long_layer_names_leave_every_title_of_the_figure_inside_it(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_mp.diagnostics import plots

    history = _history()
    for sample in history.samples:  # long names narrow the heatmaps, and their titles ran past the right edge
        sample.layers = ["model.encoder.layer.11.attention.self.query_key_value.weight", "decoder.lstm.weight_hh_l0"]
    seen = []
    close = plt.close
    plots_close = lambda figure: (seen.append(figure), None)[1]  # noqa: E731  keep the figure to measure it
    plt.close = plots_close
    try:
        plots.plot_history(history, tmp_path / "report.png")
    finally:
        plt.close = close
    figure = seen[0]
    renderer = figure.canvas.get_renderer()
    for axis in figure.axes:
        box = axis.title.get_window_extent(renderer)
        if axis.title.get_text():
            assert box.x0 >= 0 and box.x1 <= figure.bbox.width, axis.title.get_text()
    close(figure)


def _fit_tiny(callbacks, steps=2, **kwargs):
    from lightning_mp import MixedPrecisionPlugin
    from tests.helpers import TinyRegressor, make_trainer, regression_loader

    trainer = make_trainer(MixedPrecisionPlugin("bf16-mixed"), callbacks=callbacks, max_steps=steps, **kwargs)
    trainer.fit(TinyRegressor(), regression_loader())
    return trainer


def test_reports_never_land_loose_in_the_working_directory(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger

    monkeypatch.chdir(tmp_path)
    _fit_tiny([PrecisionMonitor(sample_every=1)])  # logger=False, no default_root_dir: both are the cwd
    assert (tmp_path / "precision_reports" / "precision_report.md").is_file()
    assert not (tmp_path / "precision_report.md").exists()
    # a logger writing into the working directory (scvi-tools: save_dir=os.getcwd()): the default_root_dir
    logger = CSVLogger(save_dir=tmp_path, name="", version="")
    assert Path(logger.log_dir) == tmp_path
    _fit_tiny([PrecisionMonitor(sample_every=1)], logger=logger, default_root_dir=tmp_path / "root")
    assert (tmp_path / "root" / "precision_report.md").is_file()


def test_a_second_run_into_the_same_directory_keeps_the_first_report(tmp_path):
    first = PrecisionMonitor(sample_every=1)
    _fit_tiny([first], default_root_dir=tmp_path)
    before = first.report_files.markdown.read_text()
    second = PrecisionMonitor(sample_every=1)
    _fit_tiny([second], steps=3, default_root_dir=tmp_path)
    assert first.report_files.markdown.read_text() == before  # not overwritten
    assert second.report_files.markdown.name == "precision_report_1.md"
    text = second.report_files.markdown.read_text()
    assert "bf16 run: 3 optimizer steps" in text and "(precision_report_1.png)" in text
    assert second.report_files.png.name == "precision_report_1.png" and second.report_files.png.is_file()
    assert RunHistory.load(tmp_path / "precision_diagnostics_1.json").steps == 3
    assert RunHistory.load(tmp_path).steps == 2  # the directory's first report, as before


def test_a_short_run_gets_at_least_five_gradient_samples_with_the_default_sample_every(tmp_path):
    from lightning_mp.diagnostics.monitor import sampling_interval

    assert [sampling_interval(100, n) for n in (36, 4, 500, 10_000, math.inf)] == [7, 1, 100, 100, 100]
    assert sampling_interval(0, 36) == 0
    monitor = PrecisionMonitor(report=False)  # sample_every=None: 100, or fewer in a short run
    _fit_tiny([monitor], steps=36, default_root_dir=tmp_path, max_epochs=10)  # 8 batches an epoch: 36 steps
    assert [s.step for s in monitor.history.samples_of("param_grads")] == [0, 7, 14, 21, 28, 35]
    assert monitor.history.sample_every == 7
    explicit = PrecisionMonitor(sample_every=100, report=False)  # a number is taken as given
    _fit_tiny([explicit], steps=12, default_root_dir=tmp_path)
    assert [s.step for s in explicit.history.samples_of("param_grads")] == [0]
