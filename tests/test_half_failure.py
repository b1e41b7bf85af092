"""Half-precision failures that are not gradient overflows, explained at the first forward: an op with no fp16
kernel on the CPU (``nn.LSTM``), a constant that does not fit fp16 (``masked_fill(-1e9)``). The error names the
module (qualified name and class), the op and the cast-policy line that fixes it, is raised from the original, and
following it trains (Trainer and Fabric; masters off and on); errors of another kind pass through untouched."""

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
    original = caught.value.__cause__
    assert type(original) is RuntimeError and "primitive descriptor for the LSTM forward" in str(original)
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
    assert "without overflow" in str(caught.value.__cause__)


@pytest.mark.parametrize("masters", [False, True], ids=["fp32-model", "masters"])
def test_following_the_advice_trains_and_matches_fp32(masters):
    """Apply each error's fix until fit runs: two errors (LSTM, then the mask), then a loss within fp16's rounding
    of the fp32 run from the same weights and data."""
    rules: list[str] = []
    for _ in range(3):
        try:
            _, loss = fit(MixedPrecisionPlugin(master_weights=masters, policy={"fp32_modules": rules}), True)
            break
        except HalfPrecisionError as error:
            rules.append(error.failure.rule)
    assert rules == ["LSTM", "MaskedAttention"]
    _, reference = fit(None, attention=True)
    assert loss == pytest.approx(reference, rel=2e-2)


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

    with pytest.raises(HalfPrecisionError, match=r"^encoder.lstm \(LSTM\) cannot run in float16") as caught:
        run([])
    assert caught.value.failure.rule == "LSTM"
    with pytest.raises(HalfPrecisionError, match=r"^attention \(MaskedAttention\) writes -1e\+09"):
        run(["LSTM"])
    assert run(["LSTM", "MaskedAttention"]) == pytest.approx(run(None), rel=2e-2)


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
