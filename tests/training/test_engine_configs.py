"""The shipped accelerate configs (configs/accelerate/*.yaml) load in `accelerate launch` without edits and give the
engine each one names, as the launched processes see it (the plugin accelerate builds from the launcher's
environment); DeepSpeed asked for in a CPU run is refused in one line (it cannot run here: docs/training.md).
The FSDP runs themselves are in test_distributed.py."""

import importlib.util
import os
from pathlib import Path
from unittest import mock

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

from refusion_hf import RefusionForCausalLM
from tests.cli_errors import user_error
from tests.training.toy import train_args, write_toy_jsonl

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"


def launched_environment(name: str) -> dict[str, str]:
    """The accelerate settings `accelerate launch --config_file configs/accelerate/NAME.yaml` gives its processes."""
    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / f"{name}.yaml"), "train.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command does before its DeepSpeed launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return {key: value for key, value in env.items() if key.startswith(("ACCELERATE_", "FSDP_"))}


def test_shipped_configs_are_exactly_these():
    assert sorted(path.name for path in CONFIGS.glob("*.yaml")) == [
        "deepspeed_zero2.yaml",
        "deepspeed_zero3.yaml",
        "fsdp.yaml",
    ]
    for path in CONFIGS.glob("*.yaml"):
        assert path.read_text().startswith("# "), f"{path.name} starts with a comment saying when to use it"


def test_fsdp_config_is_fsdp2_full_shard_wrapping_the_decoder_layer():
    environment = launched_environment("fsdp")
    assert environment["ACCELERATE_USE_FSDP"] == "true"
    with mock.patch.dict(os.environ, environment):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True  # full shard
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type)
    assert plugin.transformer_cls_names_to_wrap == ["Qwen3DecoderLayer"]
    assert plugin.transformer_cls_names_to_wrap == RefusionForCausalLM._no_split_modules  # the model's own unit


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_configs_are_their_zero_stage_with_the_batch_left_to_the_trainer(stage):
    environment = launched_environment(f"deepspeed_zero{stage}")
    assert environment["ACCELERATE_USE_DEEPSPEED"] == "true" and environment["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with mock.patch.dict(os.environ, environment):
        plugin = DeepSpeedPlugin()
    config = plugin.deepspeed_config
    assert config["zero_optimization"]["stage"] == stage
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert config[key] == "auto", key  # filled from refusion train's own flags
    if stage == 3:  # the final save gathers the shards into one from_pretrained folder; weights built sharded
        assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
        assert plugin.zero3_init_flag is True


def test_deepspeed_in_a_cpu_run_is_refused_in_one_line(fixture_path, tmp_path, capsys, monkeypatch):
    data = write_toy_jsonl(tmp_path / "toy.jsonl", count=4)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what a DeepSpeed config's launch sets
    message = user_error(capsys, train_args(fixture_path, data, tmp_path / "out", "--use-cpu", "--max-steps", "1"))
    if importlib.util.find_spec("deepspeed") is None:
        assert message.startswith("this needs the `deepspeed` extra (deepspeed not installed)"), message
    else:
        assert message.startswith("DeepSpeed was asked for (accelerate config or --deepspeed) in a CPU run"), message
        assert "configs/accelerate/fsdp.yaml" in message
