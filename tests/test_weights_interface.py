"""The weights interface (``lightning_mp.master.plain.PlainWeights``) carries the whole lifecycle: the two stores
implement it beside each other (the lean one is not a ``MasterWeights``), the model's own parameters answer every call
without masters, and the plugin calls it without asking whether masters exist."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.master import MasterWeights, PlainWeights, RemainderMasters
from lightning_mp.master.plain import PLAIN, StrategyMasters

ROOT = Path(__file__).resolve().parent.parent
INTERFACE = sorted(name for name in vars(PlainWeights) if not name.startswith("_"))


def test_the_lean_store_is_beside_the_flat_one_and_both_implement_the_interface():
    assert not issubclass(RemainderMasters, MasterWeights) and not issubclass(MasterWeights, RemainderMasters)
    for store in (MasterWeights, RemainderMasters):
        assert issubclass(store, PlainWeights)
        for name in INTERFACE:
            assert hasattr(store, name), (store.__name__, name)
            ours, theirs = getattr(store, name), getattr(PlainWeights, name)
            if callable(theirs):  # same call shape as the interface's (names of the interface's parameters kept)
                wanted = list(inspect.signature(theirs).parameters)
                assert list(inspect.signature(ours).parameters)[: len(wanted)] == wanted, (store.__name__, name)


def test_without_masters_every_lifecycle_call_leaves_the_model_and_optimizer_as_they_are():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    before = {name: param.detach().clone() for name, param in net.named_parameters()}
    optimizer = torch.optim.AdamW(net.parameters())
    groups = [list(group["params"]) for group in optimizer.param_groups]
    assert PLAIN.convert(net) is net
    PLAIN.check_callbacks([object()])
    PLAIN.attach([optimizer])
    PLAIN.follow_optimizers([optimizer])
    PLAIN.start_following(net)
    net(torch.randn(2, 4)).sum().backward()
    PLAIN.before_backward()
    PLAIN.grads_to_masters()
    PLAIN.follow_writes()
    assert list(PLAIN.pairs()) == [] and PLAIN.master_of(net[0].weight) is None
    exact = dict(PLAIN.exact_parameters(net))
    with PLAIN.exact_weights(net) as inner:
        assert inner is net
    PLAIN.restore()
    assert [list(group["params"]) for group in optimizer.param_groups] == groups
    for name, param in net.named_parameters():
        assert param.dtype == torch.float32 and param.grad is not None
        assert torch.equal(param, before[name]) and torch.equal(exact[name], before[name]), name
    assert not PLAIN.holds_masters and not PLAIN.groups_hold_masters and PLAIN.model_sync is None


def test_the_plugin_asks_the_interface_not_whether_masters_exist():
    for path in ("lightning_mp/plugin.py", "lightning_mp/fabric/driver.py", "lightning_mp/master/held_optimizers.py"):
        source = (ROOT / path).read_text()
        for question in ("masters is None", "masters is not None", "isinstance(self.masters", "owns_masters"):
            assert question not in source, (path, question)
    for option, holds in ((False, False), (True, True), ("remainder", True)):
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=option)
        assert plugin.master_weights is holds and plugin.steps.weights.holds_masters is holds
        assert (plugin.masters is None) is not holds  # the public attribute: None without master weights


def test_under_fsdp2_with_fp32_masters_the_strategys_shards_answer_the_lifecycle():
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mp.distributed import sync_for

    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=True)
    strategy = ModelParallelStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    own = plugin.masters
    adopted = sync_for(strategy, plugin).adopt(own)
    assert isinstance(adopted, StrategyMasters) and sync_for(strategy, plugin).adopt(adopted) is adopted
    assert adopted.holds_masters and adopted.option is True and not adopted.groups_hold_masters
    net = nn.Linear(4, 3)
    before = net.weight.detach().clone()
    assert adopted.convert(net) is net and net.weight.dtype == torch.float32 and torch.equal(net.weight, before)
    plugin.masters = adopted
    assert plugin.master_weights and repr(plugin).count("master_weights=True") == 1
    assert sync_for(None, plugin).adopt(adopted) is own  # one device again: the plugin's own store
    assert sync_for(strategy, MixedPrecisionPlugin("bf16-mixed")).adopt(None) is None
