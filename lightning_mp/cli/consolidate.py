"""``python -m lightning_mp consolidate CHECKPOINT OUT.pt``: the model's weights as one fp32 state dict.

CHECKPOINT is what the Trainer wrote: a distributed checkpoint folder (FSDP2 through ``ModelParallelStrategy``, whose
default is one shard per rank plus ``meta.pt``) or a single ``.ckpt`` file. OUT.pt holds ``{name: tensor}`` with
every floating-point tensor in fp32, in one process and without the ranks that wrote it, and loads with
``model.load_state_dict(torch.load("OUT.pt"), strict=True)`` into the LightningModule built as usual (not sharded).

Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` (2.6) expects Fabric's ``"model"`` key
and fails on the Trainer's distributed checkpoint (``KeyError: 'model'``); Fabric's and torch's ``dcp_to_torch_save``
convert the whole checkpoint, optimizer state included, each tensor in the dtype it was saved in. This reads only
the model's entries.
"""

from __future__ import annotations

import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from jsonargparse import ArgumentParser

_META = "meta.pt"


class ConsolidateError(ValueError):
    """The checkpoint cannot be consolidated; the message names it and says why."""


def consolidate(checkpoint: Union[str, Path], output: Union[str, Path], key: str = "state_dict") -> dict[str, Any]:
    """Write the weights of ``checkpoint`` (a distributed checkpoint folder or a ``.ckpt`` file) to ``output`` as one
    state dict, floating-point tensors in fp32; returns what was written.

    Args:
        checkpoint: the folder (with ``.metadata``, as ``torch.distributed.checkpoint`` writes it) or the file.
        output: the file to write (``torch.save``); its folder is created.
        key: the entry that holds the model (default ``"state_dict"``, the Trainer's; Fabric's is ``"model"``).

    Raises:
        ConsolidateError: the checkpoint is missing, not a checkpoint, or has no ``key`` entry.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise ConsolidateError(f"{checkpoint}: no such file or folder.")
    weights = _read_distributed(path, key) if path.is_dir() else _read_file(path, key)
    state = {name: value.float() if value.is_floating_point() else value for name, value in weights.items()}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, output)
    return state


def _read_distributed(path: Path, key: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / ".metadata").is_file():
        raise ConsolidateError(
            f"{path} is a folder without .metadata: not a distributed checkpoint (pass the "
            "folder the Trainer saved, e.g. checkpoints/epoch=1-step=8.ckpt/, or a .ckpt file)."
        )
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    weights: dict[str, torch.Tensor] = {}
    skipped = []
    for flat_key, entry in metadata.state_dict_metadata.items():
        where = metadata.planner_data.get(flat_key, tuple(flat_key.split(".", 1)))
        if where[0] != key:
            continue
        name = ".".join(str(part) for part in where[1:])
        if isinstance(entry, TensorStorageMetadata):
            weights[name] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            skipped.append(name)
    if skipped:
        raise ConsolidateError(f"{path}: the model entries {skipped[:5]} are not tensors, which this does not read.")
    if not weights:
        top = sorted({str(metadata.planner_data.get(k, (k,))[0]) for k in metadata.state_dict_metadata})
        raise ConsolidateError(f"{path} holds no {key!r} entry (it holds {top}): pass --key with one of them.")
    with warnings.catch_warnings():  # no process group here, and none is needed: one process reads every shard
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({key: weights}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return weights


def _read_file(path: Path, key: str) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as err:
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConsolidateError(f"{path} is not a checkpoint torch.load can read: {first}") from err
    if not isinstance(loaded, dict) or not isinstance(loaded.get(key), dict):
        keys = sorted(loaded)[:8] if isinstance(loaded, dict) else type(loaded).__name__
        raise ConsolidateError(f"{path} holds no {key!r} entry ({keys}): pass --key with the one that holds the model.")
    return {name: value for name, value in loaded[key].items() if isinstance(value, torch.Tensor)}


#: what ``consolidate`` does, in one sentence: its ``--help`` and its line in ``python -m lightning_mp --help``
SUMMARY = (
    "Write the model weights of a checkpoint (an FSDP2 distributed checkpoint folder or a .ckpt file) as one fp32 "
    "state dict, for model.load_state_dict(torch.load(OUT), strict=True)."
)


def parser(prog: str = "python -m lightning_mp consolidate") -> ArgumentParser:
    """The command line of ``consolidate``; ``python -m lightning_mp --help`` lists it with the Trainer's commands."""
    parsed = ArgumentParser(prog=prog, description=SUMMARY)
    parsed.add_argument("checkpoint", type=str, help="the distributed checkpoint folder, or a .ckpt file")
    parsed.add_argument("output", type=str, help="the file to write, e.g. model.pt")
    parsed.add_argument("--key", type=str, default="state_dict", help="the entry holding the model")
    return parsed


def main(args: Optional[list[str]] = None, prog: str = "python -m lightning_mp consolidate") -> None:
    """``python -m lightning_mp consolidate CHECKPOINT OUT.pt [--key state_dict]``; errors in one line, exit 2."""
    parsed = parser(prog).parse_args(args)
    try:
        state = consolidate(parsed.checkpoint, parsed.output, parsed.key)
    except ConsolidateError as err:
        print(f"lightning_mp: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(
        f"lightning_mp: wrote {len(state)} tensors ({size / 2**20:.1f} MiB, floating point in fp32) from "
        f"{parsed.checkpoint} to {parsed.output}; load them with model.load_state_dict(torch.load("
        f"{str(parsed.output)!r}), strict=True)."
    )


if __name__ == "__main__":
    main()
