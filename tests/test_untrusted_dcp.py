"""A sharded (DCP) checkpoint is untrusted input: no code runs from it, no unlisted byte is read.

One small FSDP run in one process (checkpoints at steps 2 and 4) is made once. Each case
crafts step 4 the way anyone who can write the directory could, checksums recomputed so
the manifest agrees, and checks that restore and export both fall back to step 2 with the
reason, and that a payload's code never ran (its marker file is never written).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from checkpoints import RunsCode
from launch import python_module, train_ok
from reference_impl.checkpoint import CheckpointManager
from reference_impl.checkpoint.dcp_safe import ConfinedReader, WeightsOnlyFullPlanner
from reference_impl.export import export
from reference_impl.metrics import EventLog

pytestmark = pytest.mark.timeout(120)

FLAGS = ["--strategy", "fsdp", "--model", "transformer", "--max-steps", "4", "--checkpoint-every", "2",
         "--keep-last", "3", "--warmup-steps", "1", "--micro-batch-size", "4", "--dataset-size", "64",
         "--log-every", "2"]
STEP = "step-00000004"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("dcp") / "ckpt"
    run = python_module([*FLAGS, "--checkpoint-dir", str(ckpt)], timeout=90)
    assert run.returncode == 0, run.stderr
    return ckpt


def relist_all(step: Path) -> None:
    """Rewrite the manifest so that it lists exactly what is on disk, with true checksums."""
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"] = {}
    for path in sorted(step.rglob("*")):
        if path.is_file() and path.name != "manifest.json":
            data = path.read_bytes()
            manifest["files"][path.relative_to(step).as_posix()] = {
                "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (step / "manifest.json").write_text(json.dumps(manifest))


def unlist(step: Path, name: str) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["files"][name]
    (step / "manifest.json").write_text(json.dumps(manifest))


def saved_metadata(step: Path) -> object:
    with (step / "dcp" / ".metadata").open("rb") as f:
        return pickle.load(f)  # the test's own trusted copy


def write_metadata(step: Path, metadata: object) -> None:
    with (step / "dcp" / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)


def code_in_metadata(step: Path, marker: Path) -> None:
    """`.metadata` is a pickle: make it one that runs code when unpickled."""
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    relist_all(step)


def calls_torch(name: str, *args: object) -> bytes:
    """A pickle that calls `torch.<name>(*args)` when unpickled, naming the function as an
    attribute of `torch` (opcode GLOBAL "torch <name>") as a crafted file can; pickle itself
    would name the defining module, such as torch.serialization for torch.save."""
    return b"\x80\x02c" + f"torch\n{name}\n".encode() + pickle.dumps(args, protocol=2)[2:-1] + b"R."


def torch_save_in_metadata(step: Path, marker: Path) -> None:
    """`.metadata` that calls torch.save: a write of any file the trainer may write."""
    (step / "dcp" / ".metadata").write_bytes(calls_torch("save", {"written": "by the checkpoint"}, str(marker)))
    relist_all(step)


def torch_seed_in_metadata(step: Path, marker: Path) -> None:
    """`.metadata` that calls torch.manual_seed: every later random draw of the run changes."""
    (step / "dcp" / ".metadata").write_bytes(calls_torch("manual_seed", 1234))
    relist_all(step)


def torch_default_dtype_in_metadata(step: Path, marker: Path) -> None:
    """`.metadata` that calls torch.set_default_dtype, with an allowed dtype as its argument."""
    (step / "dcp" / ".metadata").write_bytes(calls_torch("set_default_dtype", torch.float64))
    relist_all(step)


def code_in_a_plain_item(step: Path, marker: Path) -> None:
    """A learning rate, stored by DCP as torch.save bytes, replaced by an object that runs code."""
    full: dict = {}
    _load_state_dict(full, storage_reader=ConfinedReader(step / "dcp"), planner=WeightsOnlyFullPlanner(),
                     no_dist=True)
    key = next(k for k in full["model_optim"]["optim"] if k.endswith(".lr"))
    full["model_optim"]["optim"][key] = RunsCode(marker)
    shutil.rmtree(step / "dcp")
    dcp.save(full, checkpoint_id=step / "dcp", no_dist=True)
    relist_all(step)


def shard_outside(step: Path, marker: Path) -> None:
    """A well-formed `.metadata` whose shard paths climb into step 2's directory."""
    metadata = saved_metadata(step)
    for info in metadata.storage_data.values():
        info.relative_path = f"../../step-00000002/dcp/{info.relative_path}"
    write_metadata(step, metadata)
    relist_all(step)


def shard_unlisted_and_flipped(step: Path, marker: Path) -> None:
    unlist(step, "dcp/__0_0.distcp")
    shard = step / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def shard_unlisted_and_swapped(step: Path, marker: Path) -> None:
    unlist(step, "dcp/__0_0.distcp")
    shutil.copyfile(step.parent / "step-00000002" / "dcp" / "__0_0.distcp", step / "dcp" / "__0_0.distcp")


def shard_unlisted_and_deleted(step: Path, marker: Path) -> None:
    unlist(step, "dcp/__0_0.distcp")
    (step / "dcp" / "__0_0.distcp").unlink()


def shard_dir_is_a_link(step: Path, marker: Path) -> None:
    """`dcp/` moved out and linked back: the same bytes and checksums, reached through a link."""
    moved = step.parent.parent / "moved-dcp"
    shutil.move(step / "dcp", moved)
    (step / "dcp").symlink_to(moved, target_is_directory=True)


def a_huge_tensor_size(step: Path, marker: Path) -> None:
    """A size of 10**12 elements: allocating it before reading would take the machine down."""
    metadata = saved_metadata(step)
    item = metadata.state_dict_metadata["model_optim.model.pos"]
    item.size = torch.Size([10**6, 10**6])
    write_metadata(step, metadata)
    relist_all(step)


def integer_key_path(step: Path, marker: Path) -> None:
    """An integer in a key path makes DCP grow a list to that length."""
    metadata = saved_metadata(step)
    key = next(iter(metadata.planner_data))
    metadata.planner_data[key] = ("model_optim", 10**12)
    write_metadata(step, metadata)
    relist_all(step)


CASES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "code_in_metadata": (code_in_metadata, ".metadata refused: UnpicklingError: posix.system is not"),
    # Functions of torch itself: only its dtypes and torch.Size may be named.
    "torch_save_in_metadata": (torch_save_in_metadata, ".metadata refused: UnpicklingError: torch.save is not"),
    "torch_seed_in_metadata": (torch_seed_in_metadata, "UnpicklingError: torch.manual_seed is not"),
    "torch_default_dtype_in_metadata": (torch_default_dtype_in_metadata,
                                        "UnpicklingError: torch.set_default_dtype is not"),
    "code_in_a_plain_item": (code_in_a_plain_item, "refused by the weights-only loader"),
    "shard_outside_the_step": (shard_outside, "not a file of this directory"),
    "shard_unlisted_and_flipped": (shard_unlisted_and_flipped, "dcp/__0_0.distcp, not listed in the manifest"),
    "shard_unlisted_and_swapped": (shard_unlisted_and_swapped, "dcp/__0_0.distcp, not listed in the manifest"),
    "shard_unlisted_and_deleted": (shard_unlisted_and_deleted, "not a file of this directory"),
    "shard_dir_is_a_link": (shard_dir_is_a_link, "reached through a symbolic link"),
    "a_huge_tensor_size": (a_huge_tensor_size, "do not cover"),
    "integer_key_path": (integer_key_path, "malformed key paths"),
}


IN_THE_TRAINER = {"code_in_metadata", "code_in_a_plain_item", "shard_outside_the_step"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_dcp_checkpoint_runs_no_code_and_restore_and_export_fall_back(
        case: str, pristine: Path, tmp_path: Path) -> None:
    ckpt, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    shutil.copytree(pristine, ckpt)
    craft, reason = CASES[case]
    craft(ckpt / STEP, marker)
    assert not marker.exists(), "crafting itself ran nothing"

    stream = io.StringIO()
    rng, dtype = torch.get_rng_state(), torch.get_default_dtype()
    try:
        chosen = CheckpointManager(ckpt, EventLog(0, stream)).choose()
        assert torch.equal(torch.get_rng_state(), rng), "the checkpoint reseeded torch"
        assert torch.get_default_dtype() == dtype, "the checkpoint changed torch's default dtype"
    finally:  # for the tests after this one in the process
        torch.set_rng_state(rng)
        torch.set_default_dtype(dtype)
    assert chosen is not None and chosen.path.name == "step-00000002"
    skipped = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["event"] for e in skipped] == ["checkpoint_skipped"] and reason in skipped[0]["reason"], skipped

    out = tmp_path / "model.pt"
    assert export(ckpt, out, EventLog(0, io.StringIO())).name == "step-00000002"
    assert torch.load(out, weights_only=True)["step"] == 2

    if case in IN_THE_TRAINER:  # the trainer restores through the same chooser: its own run for the payloads
        run = python_module([*FLAGS, "--checkpoint-dir", str(ckpt)], timeout=90)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.of("checkpoint_restored")[0]["step"] == 2
        assert reason in run.of("checkpoint_skipped")[0]["reason"]
    assert not marker.exists(), "no code from the checkpoint ever ran"


def test_dcp_metadata_is_read_with_an_allow_list_not_plain_pickle(pristine: Path, tmp_path: Path) -> None:
    """Negative control: the same crafted `.metadata` under DCP's own reader runs the payload."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    shutil.copytree(pristine, ckpt)
    code_in_metadata(ckpt / STEP, marker)
    with pytest.raises(Exception):  # noqa: B017 - whatever DCP makes of it afterwards
        dcp.FileSystemReader(ckpt / STEP / "dcp").read_metadata()
    assert marker.exists(), "DCP's reader unpickles with plain pickle: the reason for dcp_safe"


def renamed_key(step: Path) -> None:
    """Consistent metadata of another model: one parameter saved under a name this model lacks."""
    metadata = saved_metadata(step)
    old, new = "model_optim.model.pos", "model_optim.model.position"
    metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
    for index in [i for i in metadata.storage_data if i.fqn == old]:
        metadata.storage_data[type(index)(new, index.offset, index.index)] = metadata.storage_data.pop(index)
    metadata.planner_data[new] = ("model_optim", "model", "position")
    del metadata.planner_data[old]
    write_metadata(step, metadata)
    relist_all(step)


@pytest.mark.distributed
def test_when_any_rank_cannot_load_its_part_every_rank_falls_back_together(pristine: Path, tmp_path: Path) -> None:
    """Every file verifies, but the saved keys do not fit the model: each rank's dry run of its
    read plan refuses before anything is loaded, and both ranks restore step 2 instead."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    renamed_key(ckpt / STEP)
    assert CheckpointManager(ckpt, EventLog(0, io.StringIO())).choose().path.name == STEP, "only a load can tell"
    run = train_ok([*FLAGS, "--micro-batch-size", "2"], ckpt)  # the same global batch on two ranks
    assert run.of("checkpoint_restored")[0]["step"] == 2
    assert "rank 0: dcp/ does not fit this model: Missing key" in run.of("checkpoint_skipped")[0]["reason"]
