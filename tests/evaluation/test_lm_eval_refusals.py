"""`refusion lm-eval` refuses, in one line and before anything loads, the model args that lm-eval would otherwise
carry to a traceback: a decoding knob out of range (`slot_size=0` failed at the first request), before anything loads,
and a tokenizer that transformers loads only by running its own code, without `trust_remote_code=True`. Through the
real CLI (`refusion_hf.cli.main`), and through `RefusionLM` as lm-eval builds it."""

import json
import shutil

import pytest

from refusion_hf.errors import InputError
from refusion_hf.evaluation.lm_eval_model import RefusionLM
from tests.cli_errors import user_error
from tests.oracle import FIXTURE

MARKER = "tokenizer code ran"


def _lm_eval(model_args: str) -> list[str]:
    # one problem: should a refusal fail, the run it lets through stays short
    return ["lm-eval", "run", "--model", "refusion", "--model_args", model_args, "--tasks", "refusion_synthetic",
            "--metadata", '{"num_problems": 1}']  # fmt: skip


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(
    "knobs, message",
    [
        ("slot_size=0", "--model_args slot_size=0: `slot_size` must be an integer >= 1, got 0. Fix it, or drop it"),
        ("slot_size=3,block_size=8", "--model_args slot_size=3, block_size=8: `block_size` must be a positive "
                                     "multiple of `slot_size` (3), got 8"),
        ("remask_threshold=1.5", "--model_args remask_threshold=1.5: `remask_threshold` must be a number in (0, 1]"),
        ("decoding=greedy", "--model_args decoding=greedy: `decoding` must be one of ('refusion', 'autoregressive')"),
    ],
    ids=["slot_size=0", "block not a multiple", "remask_threshold above 1", "unknown decoding"],
)  # fmt: skip
def test_a_decoding_knob_out_of_range_is_one_line(knobs, message, capsys, offline):
    assert user_error(capsys, _lm_eval(f"pretrained={FIXTURE},{knobs}")).startswith(message)


def test_a_knob_is_checked_against_the_folders_generation_config(tmp_path, capsys, offline):
    """The folder's block_size 32 stays in force (as `generate` merges it): slot_size=6 does not divide it."""
    folder = tmp_path / "model"
    shutil.copytree(FIXTURE, folder)
    saved = json.loads((folder / "generation_config.json").read_text())
    saved.pop("_from_model_config")  # transformers would read none of our fields from a file with this marker
    (folder / "generation_config.json").write_text(json.dumps({**saved, "block_size": 32}))
    message = user_error(capsys, _lm_eval(f"pretrained={folder},slot_size=6"))
    assert message.startswith("--model_args slot_size=6: `block_size` must be a positive multiple of `slot_size` (6)")


def _folder_with_tokenizer_code(tmp_path, model_type: str):
    folder = tmp_path / model_type
    shutil.copytree(FIXTURE, folder)
    for name, change in (("config.json", {"model_type": model_type}),
                         ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["tok.Tok", None]},
                                                    "tokenizer_class": "Tok"})):  # fmt: skip
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    marker = tmp_path / "MARKER"
    (folder / "tok.py").write_text(f"open({str(marker)!r}, 'w').write({MARKER!r})\n")
    return folder, marker


def test_a_tokenizer_that_needs_its_own_code_is_one_line(tmp_path, capsys, offline, monkeypatch):
    """transformers refuses to load it without trust_remote_code=True (no built-in class to fall back on): refused
    before lm-eval indexes its tasks (seconds) and builds the model."""
    from lm_eval.tasks import TaskManager

    folder, marker = _folder_with_tokenizer_code(tmp_path, "refusion")

    def not_yet(*args, **kwargs):
        raise AssertionError("lm-eval indexed its tasks before the refusal")

    monkeypatch.setattr(TaskManager, "__init__", not_yet)
    message = user_error(capsys, _lm_eval(f"pretrained={folder}"))
    assert message.startswith(f"--model_args pretrained={folder}: the tokenizer needs its own code (tokenizer_config"
                              ".json auto_map {'AutoTokenizer': ['tok.Tok', None]}), which transformers runs only with "
                              "trust_remote_code=True: add trust_remote_code=True to --model_args")  # fmt: skip
    assert not marker.exists(), "no code of the folder ran"


def test_the_model_class_refuses_them(tmp_path, offline):
    """lm-eval's `simple_evaluate(model="refusion", model_args=...)` builds `RefusionLM` without `refusion lm-eval`'s
    checks: the class itself refuses (the knobs before HFLM loads anything)."""
    with pytest.raises(InputError, match="slot_size=0: `slot_size` must be an integer >= 1"):
        RefusionLM(pretrained=str(FIXTURE), slot_size=0)
    folder, marker = _folder_with_tokenizer_code(tmp_path, "refusion")
    with pytest.raises(InputError, match=f"--model_args pretrained={folder}: the tokenizer needs its own code"):
        RefusionLM(pretrained=str(folder))
    with pytest.raises(InputError, match=f"--model_args tokenizer={folder}: the tokenizer needs its own code"):
        RefusionLM(pretrained=str(FIXTURE), tokenizer=str(folder))
    assert not marker.exists()
