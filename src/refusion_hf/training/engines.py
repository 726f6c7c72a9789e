"""What `RefusionTrainer` adds for accelerate's distributed engines (FSDP, DeepSpeed); the engines, their launch, their
checkpoints and the Trainer's use of them are accelerate's and transformers' own.

* FSDP on CPU: accelerate 1.15 turns its FSDP plugin on only on accelerators. Launched with an FSDP config and
  `use_cpu` (`--use-cpu`), it silently builds a plain multi-CPU run (DDP over gloo): the config's sharding, wrap
  policy and checkpoint format are ignored. PyTorch's FSDP2 (`fully_shard`) does run on CPU over gloo, so the
  engine the config asks for is turned on there (`use_requested_engine_on_cpu`); FSDP1 on CPU is refused.
* DeepSpeed on CPU: accelerate ignores a DeepSpeed config (or `--deepspeed`) when `use_cpu` is set, and without
  it picks no distributed backend on a machine without GPUs; refused with what to do instead.
* A model you save under FSDP with a sharded state dict (`trainer.save_model()`) is written as one full state dict,
  a normal `from_pretrained` folder (`full_state_dict`); checkpoints keep the engine's own sharded format, from
  which `--resume-from-checkpoint` resumes.
* `refusion train --resume-from-checkpoint last` takes the newest complete checkpoint also in the engines' formats
  (`engine_checkpoint_problem`: every shard a distributed checkpoint's metadata names is whole), and a launch asking
  for DeepSpeed without it installed gets one line naming the extra (`deepspeed_requested`).
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from pathlib import Path

from .._compat.accelerate import set_shared_distributed_type


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def deepspeed_requested(argv: list[str]) -> bool:
    """Whether the launch (an accelerate DeepSpeed config) or the command line (`--deepspeed`) asks for DeepSpeed."""
    return _flag("ACCELERATE_USE_DEEPSPEED") or any(a == "--deepspeed" or a.startswith("--deepspeed=") for a in argv)


def use_requested_engine_on_cpu(trainer) -> None:
    """In a CPU run (`use_cpu`), turn on the FSDP engine the launch asked for, or refuse DeepSpeed, where accelerate
    would silently train without them (see the module docstring). Call once the accelerator exists."""
    # accelerate is the train extra's: imported here, so that the checkpoint checks (and the `refusion` command,
    # which imports every command's module) work on the base install
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    if state.device.type != "cpu":
        return
    if _flag("ACCELERATE_USE_DEEPSPEED") or trainer.args.deepspeed:
        raise ValueError(
            "DeepSpeed was asked for (accelerate config or --deepspeed) in a CPU run: accelerate runs DeepSpeed only "
            "on GPUs and would train without it. On CPU use DDP (`accelerate launch --multi_gpu ... --use-cpu`) or "
            "FSDP (`accelerate launch --config_file configs/accelerate/fsdp.yaml ... --use-cpu`)."
        )
    if state.distributed_type != DistributedType.MULTI_CPU:
        return
    if not _flag("ACCELERATE_USE_FSDP") and trainer.args.fsdp_plugin_args is None:
        return
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = (
        FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        if trainer.args.fsdp_plugin_args is not None
        else FullyShardedDataParallelPlugin()
    )
    if plugin.fsdp_version != 2:
        raise ValueError(
            f"FSDP version {plugin.fsdp_version} in a CPU run: accelerate runs FSDP only on GPUs, and on CPU this "
            "package turns on FSDP2 only (torch's fully_shard over gloo); set fsdp_version: 2 in the accelerate config "
            "(as configs/accelerate/fsdp.yaml does)."
        )
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    set_shared_distributed_type(DistributedType.FSDP)  # as AcceleratorState.__init__ does
    trainer.is_fsdp_enabled = True


@contextlib.contextmanager
def full_state_dict(trainer):
    """Inside: a model saved under FSDP is gathered into one full state dict (a normal `from_pretrained` folder)
    instead of the sharded one, whatever `fsdp_state_dict_type` says; the setting is restored after."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    if plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        yield
        return
    sharded = plugin.state_dict_type
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        yield
    finally:
        plugin.set_state_dict_type(sharded)


# -- the engines' checkpoint formats (what `refusion train --resume-from-checkpoint last` accepts) -------------------

FSDP_MODEL_NAME = "pytorch_model_fsdp"  # accelerate's names (accelerate.utils.constants)
FSDP_OPTIMIZER_NAME = "optimizer"


def holds_engine_checkpoint(folder: Path) -> bool:
    """Whether a Trainer checkpoint folder holds the model in FSDP's or DeepSpeed's own format (no
    model.safetensors: FSDP with a sharded state dict writes `pytorch_model_fsdp_0/`, DeepSpeed `global_step*/`)."""
    return any(folder.glob(f"{FSDP_MODEL_NAME}*")) or (folder / "latest").is_file()


def engine_checkpoint_problem(folder: Path, needs_optimizer: bool = True) -> str | None:
    """Why the FSDP / DeepSpeed checkpoint in `folder` is incomplete (None when complete): every file a distributed
    checkpoint's `.metadata` names is there and long enough; files written by torch.save are whole zips."""
    if (folder / "latest").is_file():  # DeepSpeed (format not exercised on CPU): `latest` names the tag folder
        tag = folder / (folder / "latest").read_text().strip()
        saved = sorted(tag.glob("*model_states.pt"))
        if not saved:
            return f"{tag.name}/ holds no DeepSpeed model states"
        saved += sorted(tag.glob("*optim_states.pt")) if needs_optimizer else []
    else:  # FSDP: a sharded state dict is a distributed-checkpoint folder, a full one a single file
        saved = []
        for part in [FSDP_MODEL_NAME] + ([FSDP_OPTIMIZER_NAME] if needs_optimizer else []):
            found = sorted(folder.glob(f"{part}_[0-9]")) + sorted(folder.glob(f"{part}.bin"))
            if not found:
                return f"no {part}_0/ or {part}.bin"
            saved += found
    for path in saved:
        problem = _dcp_problem(path) if path.is_dir() else torch_save_problem(path)
        if problem:
            return problem
    return None


def _dcp_problem(folder: Path) -> str | None:
    """A torch.distributed.checkpoint folder: `.metadata` is written last, after every rank's files."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as error:  # noqa: BLE001 - missing or cut: whatever the unpickler raises
        return f"{folder.name}/.metadata missing or unreadable ({type(error).__name__})"
    for info in metadata.storage_data.values():
        path = folder / info.relative_path
        if not path.is_file() or path.stat().st_size < info.offset + info.length:
            return f"{folder.name}/{info.relative_path} missing or incomplete"
    return None


def torch_save_problem(path: Path) -> str | None:
    """Why a file written by torch.save is not whole (None when it is)."""
    try:
        zipfile.ZipFile(path).close()  # torch.save writes a zip: a cut file has no central directory
    except (OSError, zipfile.BadZipFile):
        return f"{path.name} missing or incomplete"
    return None


__all__ = [
    "deepspeed_requested",
    "engine_checkpoint_problem",
    "full_state_dict",
    "holds_engine_checkpoint",
    "torch_save_problem",
    "use_requested_engine_on_cpu",
]
