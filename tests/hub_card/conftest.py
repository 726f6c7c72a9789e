from __future__ import annotations

import json
from pathlib import Path

import pytest

from refusion_hf.checkpoint_identity import weights_sha256

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "tiny-qwen3-refusion"
REPO_ID = "test-org/tiny-refusion"
EXAMPLE_PROMPT = "t5 t6 t7 t8"
# Decoding defaults baked into the published folder: all differ from the package defaults, so anything that reads
# them from the saved generation config (card, remote code) shows whether it really did.
PUBLISHED_DEFAULTS = {"slot_size": 8, "block_size": 32, "token_threshold": 0.5, "max_new_tokens": 48}

SYNTHETIC_EVAL = {
    "refusion": {
        "accuracy": 0.55,
        "tokens_per_second": 120.5,
        "tokens_per_forward": 2.75,
        "num_forward_passes": 310,
        "wall_seconds": 9.1,
    },
    "autoregressive": {
        "accuracy": 0.5,
        "tokens_per_second": 40.0,
        "tokens_per_forward": 1.0,
        "num_forward_passes": 850,
    },
    # The shape `refusion eval --json` writes: CLI overrides at the top (None = not given), the resolved decoding
    # knobs under `refusion_decoding`, plus run details the card must not repeat (paths, sandbox, token ids).
    "settings": {
        "suite": "synthetic",
        "seed": 1234,
        "limit": 60,
        "split": "test",
        "families": ["arithmetic", "listing"],
        "num_problems": 60,
        "max_new_tokens": 128,
        "batch_size": 1,
        "temperature": None,
        "slot_size": None,
        "block_size": None,
        "slot_threshold": None,
        "token_threshold": 0.5,
        "allow_code_execution": False,
        "code_timeout": 5.0,
        "eos_token_ids": [1],
        "pad_token_id": 0,
        "model": "/a/local/path",
        "model_sha256": weights_sha256(FIXTURE),
        "data_file": None,
        "dtype": "float32",
        "refusion_decoding": {
            "slot_size": 8,
            "block_size": None,
            "slot_threshold": 0.9,
            "token_threshold": 0.5,
            "mask_token_id": 3,
        },
    },
    "per_example": [{"id": 0, "correct": True}],
}
HUMANEVAL_EVAL = {
    "refusion": {"accuracy": 0.25, "tokens_per_second": 88.0, "tokens_per_forward": 2.0, "num_forward_passes": 90},
    "autoregressive": {
        "accuracy": 0.3,
        "tokens_per_second": 44.0,
        "tokens_per_forward": 1.0,
        "num_forward_passes": 180,
    },
    "settings": {
        "suite": "humaneval",
        "seed": 0,
        "limit": None,
        "slot_size": 8,
        "model_sha256": weights_sha256(FIXTURE),
    },
}
TRAINER_STATE = {
    "global_step": 40,
    "epoch": 2.0,
    "max_steps": 40,
    "num_train_epochs": 2,
    "train_batch_size": 4,
    "log_history": [
        {
            "step": step,
            "epoch": step / 20,
            "loss": 4.0 - step / 20,
            "ar_loss": 2.0,
            "mdm_loss": 2.0 - step / 20,
            "learning_rate": 1e-4 * (1 - step / 40),
            "grad_norm": 1.0,
        }
        for step in range(2, 41, 2)
    ]
    + [{"step": 40, "epoch": 2.0, "train_loss": 3.1, "train_runtime": 12.5, "train_samples_per_second": 9.0}],
}


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every card and publish test runs a tiny model: one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def inputs_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("inputs")
    write_json(folder / "synthetic.json", SYNTHETIC_EVAL)
    write_json(folder / "humaneval.json", HUMANEVAL_EVAL)
    write_json(folder / "trainer_state.json", TRAINER_STATE)
    return folder


@pytest.fixture(scope="session")
def published(tmp_path_factory, inputs_dir):
    """The tiny official-format fixture published with eval reports, a trainer state and decoding defaults."""
    from refusion_hf.hub_card import publish

    out = tmp_path_factory.mktemp("published") / "tiny-refusion"
    return publish(
        FIXTURE,
        out,
        eval_paths=[inputs_dir / "synthetic.json", inputs_dir / "humaneval.json"],
        trainer_state=inputs_dir / "trainer_state.json",
        repo_id=REPO_ID,
        base_model="test-org/tiny-qwen3-ar",
        datasets=["test-org/toy-sft"],
        example_prompt=EXAMPLE_PROMPT,
        decoding_defaults=PUBLISHED_DEFAULTS,
    )
