"""Half-precision failures that are not gradient overflows, explained at the first forward: an op with no fp16
kernel on the CPU (``nn.LSTM``), a constant that does not fit fp16 (``masked_fill(-1e9)``). One error per forward
names every such op of it (module by qualified name and class, op, line) and the one cast-policy line that fixes
them all; it is raised ``from None`` with the original kept as ``.original``, and following it trains (Trainer and
Fabric; masters off and on); errors of another kind pass through untouched."""

import pickle
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin, PrecisionMonitor
from lightning_mp.diagnostics.half_failure import HalfPrecisionError
from tests.helpers import make_trainer, seeded


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class MaskedAttention(nn.Module):
    """Attention scores masked with a large negative constant, as many models write it (pytorch-forecasting's
    TFT among them): fine in fp32, an error when the scores are fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ x.transpose(1, 2)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        return scores.masked_fill(causal, -1e9).softmax(-1) @ x


class Net(nn.Module):
    def __init__(self, attention: bool) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.attention = MaskedAttention() if attention else nn.Identity()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attention(self.encoder(x)))


class Module(L.LightningModule):
    def __init__(self, attention: bool = False) -> None:
        super().__init__()
        self.net = Net(attention)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.net(x).float().squeeze(-1).mean(-1) - y).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data() -> DataLoader:
    with seeded(1):
        x, y = torch.randn(16, 5, 4), torch.randn(16)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def fit(plugin: Any, attention: bool, **kwargs: Any) -> tuple[L.Trainer, float]:
    with seeded(0):
        module = Module(attention)
    trainer = make_trainer(plugin, max_steps=4, **kwargs)
    trainer.fit(module, data())
    return trainer, _final_loss(module)


def _final_loss(module: Module) -> float:
    """The trained weights' loss on the first batch, evaluated in fp32."""
    with torch.no_grad():
        x, y = next(iter(data()))
        return float((module.net.float()(x).squeeze(-1).mean(-1) - y).pow(2).mean())


def test_lstm_under_fp16_on_cpu_names_the_module_the_op_and_the_policy_line():
    with pytest.raises(HalfPrecisionError) as caught:
        fit(MixedPrecisionPlugin(), attention=False)
    message = str(caught.value)
    assert message.startswith("net.encoder.lstm (LSTM) cannot run in float16 on cpu: op torch.lstm")
    assert 'MixedPrecisionPlugin(policy={"fp32_modules": ["LSTM"]}) (YAML: policy: {fp32_modules: [LSTM]})' in message
    assert "\n" not in message  # one line
    original = caught.value.original  # kept, but not chained: the traceback through torch's internals is not printed
    assert type(original) is RuntimeError and "primitive descriptor for the LSTM forward" in str(original)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    failure = caught.value.failure
    assert str(pickle.loads(pickle.dumps(caught.value))) == message  # a spawned rank's error reaches the parent
    assert (failure.kind, failure.module, failure.module_class, failure.rule) == ("no_kernel", "net.encoder.lstm",
                                                                                  "LSTM", "LSTM")  # fmt: skip


def test_masked_fill_overflow_names_the_value_and_adds_to_the_rules_already_there():
    with pytest.raises(HalfPrecisionError) as caught:
        fit(MixedPrecisionPlugin(policy={"preset": "conservative", "fp32_modules": ["LSTM"]}), attention=True)
    failure = caught.value.failure
    assert (failure.kind, failure.module, failure.module_class, failure.op, failure.value) == (
        "overflow", "net.attention", "MaskedAttention", "torch.Tensor.masked_fill", -1e9,
    )  # fmt: skip
    message = str(caught.value)
    assert "writes -1e+09 into a float16 tensor (op torch.Tensor.masked_fill at test_half_failure.py:" in message
    assert "beyond float16's range (largest 65504)" in message
    assert '{"preset": "conservative", "fp32_modules": ["LSTM", "MaskedAttention"]}' in message
    assert "or write torch.finfo(x.dtype).min instead of -1e+09" in message
    assert "without overflow" in str(caught.value.original)


def test_one_error_names_every_failure_of_the_forward_with_one_policy_line():
    # the LSTM (no fp16 kernel on a CPU) fails first; the forward goes on (that op in fp32) to the attention's
    # masked_fill(-1e9): one error names both, in the order the forward met them
    with pytest.raises(HalfPrecisionError) as caught:
        fit(MixedPrecisionPlugin(), attention=True)
    error = caught.value
    assert [(f.kind, f.module, f.module_class, f.op, f.rule) for f in error.failures] == [
        ("no_kernel", "net.encoder.lstm", "LSTM", "torch.lstm", "LSTM"),
        ("overflow", "net.attention", "MaskedAttention", "torch.Tensor.masked_fill", "MaskedAttention"),
    ]  # fmt: skip
    assert error.failure is error.failures[0] and error.rules == ["LSTM", "MaskedAttention"] and not error.stopped
    lines = str(error).splitlines()
    assert lines[0] == "2 ops of this forward cannot run in float16 on cpu:"
    assert lines[1].startswith("  1. net.encoder.lstm (LSTM) cannot run in float16 on cpu: op torch.lstm at test_half")
    assert lines[2].startswith("  2. net.attention (MaskedAttention) writes -1e+09 into a float16 tensor")
    assert lines[3] == (
        'Fix them all: keep them in fp32 with MixedPrecisionPlugin(policy={"fp32_modules": ["LSTM", '
        '"MaskedAttention"]}) (YAML: policy: {fp32_modules: [LSTM, MaskedAttention]}), or write '
        "torch.finfo(x.dtype).min instead of -1e+09 in MaskedAttention's forward."
    )
    assert all(f.fix == error.fix for f in error.failures)  # each failure carries the line that fixes them all
    assert "primitive descriptor for the LSTM" in str(error.original) and error.__cause__ is None
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


@pytest.mark.parametrize("masters", [False, True], ids=["fp32-model", "masters"])
def test_the_one_policy_line_trains_and_matches_fp32(masters):
    """Apply the one error's policy: fit runs, to a loss within fp16's rounding of the fp32 run from the same
    weights and data."""
    with pytest.raises(HalfPrecisionError) as caught:
        fit(MixedPrecisionPlugin(master_weights=masters), attention=True)
    _, loss = fit(MixedPrecisionPlugin(master_weights=masters, policy={"fp32_modules": caught.value.rules}), True)
    _, reference = fit(None, attention=True)
    assert loss == pytest.approx(reference, rel=2e-2)


class InPlaceAttention(MaskedAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ x.transpose(1, 2)
        scores.masked_fill_(torch.ones_like(scores, dtype=torch.bool).triu(1), -1e9)
        return scores.softmax(-1) @ x


class Stack(nn.Module):
    """An LSTM on the fp32 input (torch runs an fp16 one on a CPU only on fp16 inputs), then two attention layers of
    one class writing a constant in place (``masked_fill_``): the replay runs past each, and the layers are one
    entry."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 4, batch_first=True)
        self.layers = nn.ModuleList([InPlaceAttention(), InPlaceAttention()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lstm(x)[0]
        for layer in self.layers:
            x = layer(x)
        return x


def set_up(plugin: MixedPrecisionPlugin, model: nn.Module) -> MixedPrecisionPlugin:
    plugin.convert_module(model)
    plugin.connect(model, [torch.optim.SGD(model.parameters(), lr=0.1)], [])
    return plugin


def test_layers_of_one_class_are_one_entry_and_the_replay_runs_past_in_place_writes():
    with seeded(0):
        model, x = Stack(), torch.randn(2, 5, 4)
    plugin = set_up(MixedPrecisionPlugin(), model)
    with pytest.raises(HalfPrecisionError) as caught, plugin.forward_context():
        model(x)
    error = caught.value
    assert [(f.module, f.also, f.op) for f in error.failures] == [
        ("lstm", (), "torch.lstm"),
        ("layers.0", ("layers.1",), "torch.Tensor.masked_fill_"),
    ]  # fmt: skip
    assert "layers.0 (InPlaceAttention) (and layers.1) writes -1e+09" in str(error)
    fixed = set_up(MixedPrecisionPlugin(policy={"fp32_modules": error.rules}), model)
    with fixed.forward_context():
        assert torch.isfinite(model(x)).all()


def test_the_fix_works_under_fabric_too():
    def run(rules: Optional[list[str]]) -> float:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecisionPlugin(policy={"fp32_modules": rules})]
                          if rules is not None else None)  # fmt: skip
        with seeded(0):
            net = Net(attention=True)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        model, optimizer = fabric.setup(net, optimizer)
        for x, y in data():
            loss = (model(x).float().squeeze(-1).mean(-1) - y).pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return float(loss)

    with pytest.raises(HalfPrecisionError, match=r"^2 ops of this forward") as caught:
        run([])
    assert [f.module for f in caught.value.failures] == ["encoder.lstm", "attention"]  # Fabric's wrapper not named
    with pytest.raises(HalfPrecisionError, match=r"^attention \(MaskedAttention\) writes -1e\+09"):
        run(["LSTM"])  # the rules already there: only what they leave
    assert run(caught.value.rules) == pytest.approx(run(None), rel=2e-2)


class Unrelated(L.LightningModule):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.error = error

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        hidden = self.layer(batch[0][:, 0])
        if self.error == "shape":
            return hidden @ torch.ones(3, 1)  # a shape error: nothing to do with half precision
        return hidden.masked_fill(hidden > 0, -1e9).sum()  # training_step's own code: no module rule reaches it

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_shape_error_passes_through_untouched_and_training_step_code_gets_the_finfo_fix():
    with pytest.raises(RuntimeError) as caught:
        make_trainer(MixedPrecisionPlugin(), max_steps=1).fit(Unrelated("shape"), data())
    assert type(caught.value) is RuntimeError and "cannot be multiplied" in str(caught.value)
    with pytest.raises(HalfPrecisionError) as caught:
        make_trainer(MixedPrecisionPlugin(), max_steps=1).fit(Unrelated("overflow"), data())
    failure = caught.value.failure
    assert (failure.module, failure.module_class, failure.rule) == ("", "Unrelated", "")
    assert "no fp32_modules rule reaches this code" in failure.fix
    assert "write torch.finfo(x.dtype).min instead of -1e+09 at test_half_failure.py:" in failure.fix


def test_the_monitor_report_of_the_crashed_run_names_the_module_and_the_fix(tmp_path):
    monitor = PrecisionMonitor(sample_every=1)
    with pytest.raises(HalfPrecisionError):
        fit(MixedPrecisionPlugin(), attention=False, callbacks=[monitor], default_root_dir=tmp_path)
    text = monitor.report_files.markdown.read_text()
    assert "Nothing to change" not in text
    assert '1. **fp32_modules**: `keep it in fp32 with MixedPrecisionPlugin(policy={"fp32_modules": ["LSTM"]})' in text
    assert "net.encoder.lstm (LSTM)" in text and "torch.lstm" in text
    assert monitor.history.half_failure["rule"] == "LSTM"


class LaterBug(nn.Module):
    """An LSTM (no fp16 kernel on a CPU), then a shape error further on in the forward: the diagnosis names the LSTM
    and says where it stopped, rather than hide either."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0] @ torch.ones(3, 1)


def test_a_failure_the_replay_cannot_run_past_is_said_with_those_before_it():
    model = LaterBug()
    plugin = set_up(MixedPrecisionPlugin(), model)
    with pytest.raises(HalfPrecisionError) as caught, plugin.forward_context():
        model(torch.randn(2, 5, 4))
    error = caught.value
    assert [f.module for f in error.failures] == ["lstm"] and error.stopped.startswith("RuntimeError: Expected size")
    assert str(error).endswith(
        f"(The diagnosis stopped early, at {error.stopped}: later ops of the forward were not checked.)"
    )


def test_the_monitor_report_names_every_failure_and_the_one_fix(tmp_path):
    monitor = PrecisionMonitor(sample_every=1)
    with pytest.raises(HalfPrecisionError) as caught:
        fit(MixedPrecisionPlugin(), attention=True, callbacks=[monitor], default_root_dir=tmp_path)
    text = monitor.report_files.markdown.read_text()
    assert f"1. **fp32_modules**: `{caught.value.fix}`" in text  # the line that fixes both
    assert "the run ended at net.encoder.lstm (LSTM), op torch.lstm" in text
    assert "; also net.attention (MaskedAttention), op torch.Tensor.masked_fill." in text
    assert [other["module"] for other in monitor.history.half_failure["others"]] == ["net.attention"]


class OwnCode(nn.Module):
    """A constant written in the module's own forward, not in a submodule of it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)
        return hidden.masked_fill(hidden > 0, -1e9)


class CallsItsNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = OwnCode()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).float().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_failure_in_the_called_modules_own_code_is_that_modules():
    # training_step calls self.net(x): the forward run again is net's, and an op in net's own code is net's (a rule
    # on its class reaches it), not code outside every module
    with pytest.raises(HalfPrecisionError) as caught:
        make_trainer(MixedPrecisionPlugin(), max_steps=1).fit(CallsItsNet(), data())
    (failure,) = caught.value.failures
    assert (failure.module, failure.module_class, failure.rule, failure.kind) == (
        "net",
        "OwnCode",
        "OwnCode",
        "overflow",
    )
    make_trainer(MixedPrecisionPlugin(policy={"fp32_modules": caught.value.rules}), max_steps=1).fit(
        CallsItsNet(), data()
    )
