"""fp8 diagnostics: the statistics of each cast against hand-computed counts, the monitor's sampling (no cost on other
steps), and the report and advice on a run whose first layer's input has an outlier column."""

from __future__ import annotations

import pytest
import torch

from lightning_mp import MixedPrecisionPlugin, PrecisionMonitor
from lightning_mp.diagnostics.advice import advise
from lightning_mp.diagnostics.run_report import render_markdown, write_report
from lightning_mp.fp8.stats import COLUMNS, cast_stats, shares
from tests.fp8_helpers import MLPModule, mlp_loader, trainer
from tests.helpers import HostSyncCounter

pytest.importorskip("torchao")


def test_cast_stats_count_flushed_subnormal_and_saturated_values_as_hand_computed():
    # e4m3fn: max 448, smallest normal 2^-6, smallest subnormal 2^-9. amax 448 -> scale 1 (tensorwise)
    values = torch.tensor([448.0, -1.0, 2.0**-10, -(2.0**-7), 0.0, 2.0**-6])
    row = dict(zip(COLUMNS, cast_stats(values, torch.float8_e4m3fn, False, False).tolist()))
    assert row == {"numel": 6, "zeros": 1, "flush": 1, "subnormal": 1, "saturated": 0, "amax": 448.0, "scale": 1.0}
    # rowwise with power-of-two scales: row amax 3 -> 448/3 = 149.3 -> 128; row amax 0.5 -> 896 -> 512
    rows = torch.tensor([[3.0, 2.0**-17], [0.5, 0.25]])
    row = dict(zip(COLUMNS, cast_stats(rows, torch.float8_e4m3fn, True, True).tolist()))
    assert row["scale"] == 128.0 and row["flush"] == 1 and row["subnormal"] == 0  # 2^-17 * 128 = 2^-10 < 2^-9
    # a fixed scale too large for the values saturates them: 500 rounds past 448 (the step at the top is 32)
    row = dict(
        zip(
            COLUMNS,
            cast_stats(torch.tensor([500.0, 463.0, 1.0]) / 448.0 * 448.0, torch.float8_e4m3fn, False, False).tolist(),
        )
    )
    assert row["saturated"] == 0  # dynamic: scale 448/500, nothing beyond max


def _outlier_loader():
    loader = mlp_loader()
    x, y = loader.dataset.tensors
    x = x.clone()
    x[:, 0] = 1e6  # one huge feature: the input's tensorwise scale shrinks everything else below fp8's range
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _run(recipe, sample_every=2, steps=4, loader=None):
    monitor = PrecisionMonitor(sample_every=sample_every, report=False)
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8=recipe)
    with HostSyncCounter() as counter:
        trainer(plugin, steps, callbacks=[monitor]).fit(MLPModule(), loader or mlp_loader())
    return monitor, counter.calls


def test_monitor_samples_every_fp8_cast_in_the_samples_one_transfer_and_nothing_on_other_steps():
    _, baseline = _run("tensorwise", sample_every=0, steps=6)
    monitor, sampled = _run("tensorwise", sample_every=3, steps=6)
    records = monitor.history.fp8_samples
    assert [r["step"] for r in records] == [0, 3] and records[0]["layers"] == ["net.0", "net.2"]
    assert len(sampled) == len(baseline) + 2 and sampled.count("tolist") == 2  # one transfer per sample, none else
    first = records[0]["casts"]
    assert first["input"][0][0] == 16 * 32 and first["weight"][1][0] == 64 * 32
    assert first["grad_output"][1][0] == 16 * 32
    assert monitor.history.fp8_recipe == "tensorwise"


def test_an_outlier_column_shows_as_flushed_input_and_the_advice_says_rowwise_then_exclude(tmp_path):
    monitor, _ = _run("tensorwise", loader=_outlier_loader())
    history = monitor.history
    flushed = shares(history.fp8_samples[-1], "input", "flush")
    assert flushed[0] > 0.5 and flushed[1] < 0.01  # net.0 reads the outlier column, net.2 does not
    advice = {item.rule: item for item in advise(history)}
    assert "fp8: rowwise" in advice["fp8"].change and "net.0 input" in advice["fp8"].evidence
    markdown = render_markdown(history)
    assert "## fp8 casts per layer" in markdown and "| net.0 | input |" in markdown
    files = write_report(history, tmp_path)
    assert files.png is None or files.png.stat().st_size > 0
    rowwise, _ = _run("rowwise", loader=_outlier_loader())  # every row holds the outlier: rowwise cannot help
    advice = {item.rule: item for item in advise(rowwise.history)}
    assert advice["fp8"].change.startswith('policy: {fp8_exclude: ["net.0"]}')


def test_history_with_fp8_samples_round_trips_through_json(tmp_path):
    monitor, _ = _run("tensorwise", steps=2)
    from lightning_mp.diagnostics.history import RunHistory

    path = monitor.history.save(tmp_path)
    loaded = RunHistory.load(path)
    assert loaded.fp8_samples == monitor.history.fp8_samples and loaded.fp8_recipe == "tensorwise"
