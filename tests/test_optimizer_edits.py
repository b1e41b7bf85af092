"""Edits users make to an optimizer between two steps of a fit, in every way the plugin steps: each run bitwise
against a reference that reads ``param_groups`` and ``optimizer.state`` afresh at every step, or a loud error before
any update of the edited step.

The edits (tests/optimizer_edits.py ``EDITS``) are the routes by which what torch's optimizer reads at ``step()``
can change: state tensors assigned, a parameter's state reset (a new dict, ``clear``, ``update``, the outer dict's
``pop`` + ``setdefault``), one layer's or all state reset, a state restored from an earlier deepcopy,
``load_state_dict``, state changed in place, ``param_groups[i]["params"]`` edited in place (``extend``, ``append``,
``del``, item assignment, ``reverse``, a permutation, a parameter moved or swapped between groups) or replaced,
``add_param_group``, a group removed or the groups reordered, options changed (lr, weight decay, betas, eps,
maximize, amsgrad, momentum off and on, nesterov). A state tensor's storage swapped (``t.data = new``) runs in a
child process (below): without a plan that keeps what it reads alive or checks it, the kernel writes freed memory.

References, and why:

- lean (``master_weights="remainder"``, the step plan of master/lean/plan.py), the step inside backward and the chunked
  step inside backward: against the chunked path (``LIGHTNING_MP_NATIVE=0``), which reads the groups and the state
  afresh at each step (torch's fused kernel on joined chunks, bitwise the plan's kernel: tests/test_lean_masters.py;
  the step inside backward is bitwise the normal lean step: tests/test_in_backward.py), and the lean modes also
  against themselves with every plan made again before each backward (``plugin.masters.step_plans`` cleared).
- ``master_weights=True``: against ``master_weights=False`` (autocast over fp32 parameters that the optimizer steps
  itself). The forward of True uses its masters' round-to-nearest-even bf16 casts, as autocast casts fp32
  parameters, and the bf16 gradients reach the fp32 tensors the optimizer steps unchanged, so without an edit the
  two runs are the same bits (asserted below), while the lean run differs from both at exact ties (DESIGN.md: its
  bf16 half rounds ties away from zero). True has no step plan; what it caches are the masters of the parameters in
  the groups and the per-step moves of master/flat_moves.py, which an edit of ``param_groups`` can make stale.
- an edit after which torch's own optimizer cannot step (``follows=False``: a state without its moments, amsgrad
  switched on over existing state, a moment of the wrong shape or dtype) must fail loudly in every lean mode, before
  any update of that step (of any group): the weights and the state afterwards are those at the start of the step.
  With ``master_weights=True`` torch's own optimizer steps the masters and raises what it raises where it raises it
  (group by group: the groups before the one it cannot step are updated), as on fp32 parameters.

Comparing a run with its reference covers the checkpoint too: ``optimizer.state_dict()`` after the run (what a
checkpoint saves) must equal the reference's, whose update used the state it holds.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.optimizer_edits import BY_NAME, EDITS, REFERENCE, STORAGE_SWAPS, difference, eight_bit_runs, fit, outcome

ROOT = Path(__file__).resolve().parent.parent

#: the modes under test and their reference mode
REFERENCE_OF = {
    "lean": "chunked",
    "lean, plans rebuilt": "chunked",
    "in backward": "chunked",
    "in backward, plans rebuilt": "chunked",
    "chunked in backward": "chunked",
    "True": "bf16-mixed",
}
#: torchao's AdamW8bit in one pass (master/lean/eightbit.py), its modes and their reference (optimizer_edits.REFERENCE)
REFERENCE_OF_8BIT = {mode: REFERENCE["adamw8bit"] for mode in ("lean", "in backward", "in backward, plans rebuilt")}
EIGHT_BIT = pytest.mark.skipif(
    not eight_bit_runs(), reason="torchao is not installed or the 8-bit one-pass kernel is not built (no C compiler)"
)
#: refused, but after some update of the step: none. The normal step checks every state before any update where a
#: group's plan does not fit (RemainderMasters.fused_step, plan.ready); the step inside backward where the state
#: changed since the last backward (plan.StateSeen, checked in StepInBackward.begin).
LATE: dict[tuple[str, str], str] = {}
CASES = [
    pytest.param(
        edit.name,
        optimizer,
        mode,
        id=f"{edit.name}-{optimizer}-{mode}",
        marks=([pytest.mark.xfail(strict=True, reason=LATE[edit.name, mode])] if (edit.name, mode) in LATE else [])
        + ([EIGHT_BIT] if optimizer == "adamw8bit" else []),
    )
    for edit in EDITS
    for optimizer in edit.optimizers
    for mode in (REFERENCE_OF_8BIT if optimizer == "adamw8bit" else REFERENCE_OF)
    if edit.modes is None or mode in edit.modes
]


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: these fits are tiny, and on a shared 2-core machine two threads mostly wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _reference(name: str, optimizer: str, mode: str) -> dict:
    return fit(mode, optimizer, BY_NAME[name])


def test_true_without_an_edit_is_bitwise_bf16_mixed_on_fp32_parameters():
    assert difference(fit("True", "adamw", None), fit("bf16-mixed", "adamw", None)) is None
    assert difference(fit("True", "sgd", None), fit("bf16-mixed", "sgd", None)) is None


def test_the_two_references_of_the_lean_modes_agree_without_an_edit():
    chunked = fit("chunked", "adamw", None)
    assert "error" not in chunked
    assert difference(fit("lean, plans rebuilt", "adamw", None), chunked) is None


@EIGHT_BIT
def test_the_8bit_matrix_steps_8bit_and_fp32_state_and_its_reference_is_the_chunked_paths_without_an_edit():
    """torchao's AdamW8bit: the model's 64x64 weights get 8-bit moments, the rest fp32 ones; without an edit the
    reference (layouts made again every step) is the generic chunked path's run (torchao's own compiled step on fp32
    slices), bit for bit, and so is the one-pass step."""
    reference = fit(REFERENCE["adamw8bit"], "adamw8bit", None)
    assert "error" not in reference
    kinds = {name: type(state["exp_avg"]).__name__ for name, state in reference["state"].items()}
    assert kinds["net.3.weight"] == "OptimState8bit"  # 4096 elements in whole blocks
    assert kinds["net.0.weight"] == kinds["head.weight"] == "Tensor"  # fewer than 4096: fp32
    chunked = fit("chunked", "adamw8bit", None)  # (its state is keyed by proxies of slices: the weights compared)
    assert "error" not in chunked
    for name, value in chunked["weights"].items():
        assert torch.equal(reference["weights"][name].view(torch.int32), value.view(torch.int32)), name
    assert difference(fit("lean", "adamw8bit", None), reference) is None


@pytest.mark.parametrize(("name", "optimizer", "mode"), CASES)
def test_an_edit_between_steps_is_followed_bitwise_or_refused_before_any_update(name, optimizer, mode):
    edit = BY_NAME[name]
    reference = _reference(name, optimizer, (REFERENCE_OF_8BIT if optimizer == "adamw8bit" else REFERENCE_OF)[mode])
    result = fit(mode, optimizer, edit)
    said = f": {type(result['error']).__name__}: {result['error']}" if "error" in result else ""
    if edit.follows:
        assert "error" not in reference, f"the reference could not run: {reference['error']!r}"
        assert outcome(result, reference) == "exact", f"{outcome(result, reference)}{said}"
    elif mode == "True":  # torch's own optimizer steps the masters: its error, where it raises it (group by group)
        assert "error" in reference and "error" in result, said
        assert type(result["error"]) is type(reference["error"]), said
        assert difference(result, reference) is None, said
    else:
        assert outcome(reference, reference) == "refused", "the reference did not refuse before any update"
        assert outcome(result, reference) == "refused", f"{outcome(result, reference)}{said}"
        assert str(result["error"]), "a refusal says why"


def test_storage_swaps_and_state_of_another_size_are_followed_or_refused_without_touching_memory_not_theirs():
    """In a child process whose glibc aborts on heap corruption (``MALLOC_CHECK_=3``), under the plan, in the lean
    step and inside backward, for a few steps: a state tensor's storage swapped (``state[p][key].data = new``, the old
    storage freed), a moment of the wrong shape, a bf16 moment (``zeros_like`` of a lean parameter). The child must
    exit cleanly; each swap bitwise the chunked path (which reads the tensors afresh) or refused before any update,
    each state the update cannot take refused before any update."""
    env = {**os.environ, "MALLOC_CHECK_": "3", "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, "-m", "tests.optimizer_edits"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr[-3000:]}"
    for sign in ("munmap_chunk", "malloc(", "free(", "corrupted", "Segmentation"):
        assert sign not in child.stderr, child.stderr[-3000:]
    lines = [line.split("|") for line in child.stdout.splitlines() if line.count("|") == 3]
    expected = [(e.name, o, m) for e in STORAGE_SWAPS for o in e.optimizers for m in ("lean", "in backward")]
    assert [tuple(line[:3]) for line in lines] == expected, child.stdout
    follows = {edit.name: edit.follows for edit in STORAGE_SWAPS}
    for name, optimizer, mode, result in lines:
        assert result.startswith("refused [") or (follows[name] and result == "exact"), (name, optimizer, mode, result)


def test_every_edit_is_named_once():
    assert len(BY_NAME) == len(EDITS)
    assert {e.name for e in STORAGE_SWAPS}.isdisjoint(BY_NAME)
