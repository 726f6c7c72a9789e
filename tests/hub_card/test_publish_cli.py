"""`refusion publish` end to end through `refusion_hf.cli.main`: the complete folder from an official-format
checkpoint, pushing through the real `HfApi` client to a local stand-in of the Hub, and one clear error line
(no traceback, exit code 1) for no token, no network, a rejected token and bad arguments."""

from __future__ import annotations

import json
import re
import shutil
import socket

import pytest
import torch
from huggingface_hub import ModelCard, constants
from safetensors.torch import load_file

from refusion_hf.cli import main
from refusion_hf.generation.custom_generate import generate
from refusion_hf.generation.refusion_generation_config import DECODING_KNOBS
from refusion_hf.hub_card import PushError, push_folder
from refusion_hf.modeling import RefusionConfig, RefusionForCausalLM
from refusion_hf.modeling.remote_code import collect_bundle_modules

from .conftest import FIXTURE, REPO_ID, SYNTHETIC_EVAL, write_json
from .hub_standin import HubStandIn

REFUSION_DEFAULTS = {
    "decoding": "refusion",
    "slot_size": 32,
    "block_size": None,
    "slot_threshold": 0.9,
    "token_threshold": 0.4,
    "mask_token_id": 3,
}


def expected_files() -> set[str]:
    remote_code = set(collect_bundle_modules(RefusionConfig, RefusionForCausalLM))
    custom_generate = {
        f"custom_generate/{name}" for name in collect_bundle_modules(generate) if name != "custom_generate.py"
    }
    custom_generate |= {"custom_generate/generate.py", "custom_generate/requirements.txt"}
    return (
        {
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        }
        | remote_code
        | custom_generate
    )


def folder_files(folder) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def run_cli(capsys, *args) -> tuple[int, str, str]:
    try:
        code = main(["publish", *map(str, args)])
    except SystemExit as exit:  # argparse refusing a flag's value
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_clear_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("refusion publish: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """The push tests talk to loopback stand-ins: make them independent of an HF_HUB_OFFLINE in the environment."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-here"))


def test_cli_publishes_official_checkpoint_in_our_format(capsys, tmp_path):
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "--model", FIXTURE, "--out", out)
    assert code == 0
    files = folder_files(out)
    assert set(files) == expected_files()
    assert "official-format checkpoint" in stdout and "--repo-id" in stdout

    config = json.loads(files["config.json"])
    assert config["model_type"] == "refusion" and config["architectures"] == ["RefusionForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_refusion.RefusionForCausalLM"
    assert config["auto_map"]["AutoConfig"] == "configuration_refusion.RefusionConfig"
    generation = json.loads(files["generation_config.json"])
    assert {key: generation.get(key) for key in REFUSION_DEFAULTS} == REFUSION_DEFAULTS

    # Weights: the very same tensors as the source checkpoint, as safetensors.
    source, published = load_file(FIXTURE / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == published.keys() and all(torch.equal(source[k], published[k]) for k in source)

    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and "custom_code" in card.data.tags
    assert card.data.eval_results is None and card.data.base_model is None
    assert "trust_remote_code=True" in card.text and "## Evaluation" not in card.text
    # Without --repo-id the card is named after the folder and the snippet shows where the id goes.
    assert card.text.lstrip().startswith("# out\n") and 'model_id = "<your-namespace>/out"' in card.text
    assert "## Training details" not in card.text


def test_every_decoding_knob_flag_is_written_to_the_generation_config(capsys, tmp_path):
    # The flags are derived from the generation config's fields (one per DECODING_KNOBS entry), --no-plan-ahead too.
    flags = ["--slot-size", "4", "--block-size", "8", "--slot-threshold", "0.7", "--token-threshold", "0.2"]
    flags += ["--remask-threshold", "0.4"]
    code, _, _ = run_cli(capsys, "--model", FIXTURE, "--out", tmp_path / "out", *flags, "--no-plan-ahead")
    assert code == 0
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    written = {name: generation[name] for name in DECODING_KNOBS}
    assert written == dict(
        slot_size=4, block_size=8, slot_threshold=0.7, token_threshold=0.2, plan_ahead=False, remask_threshold=0.4
    )


def test_cli_push_uploads_the_folder_through_hfapi(capsys, tmp_path, monkeypatch, inputs_dir):
    with HubStandIn() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", hub.token)
        out = tmp_path / "out"
        code, stdout, err = run_cli(
            capsys,
            "--model",
            FIXTURE,
            "--out",
            out,
            "--repo-id",
            REPO_ID,
            "--push",
            "--private",
            "--eval",
            inputs_dir / "synthetic.json",
        )
        assert code == 0, err
        assert hub.unexpected == []
        assert hub.repos == {
            REPO_ID: {"name": "tiny-refusion", "organization": "test-org", "visibility": "private", "type": "model"}
        }
        assert len(hub.commits) == 1
        commit = hub.commits[0]
        assert commit.repo_id == REPO_ID and commit.revision == "main" and commit.other_operations == []
        # Exactly the published folder, byte for byte: weights, config, remote code, tokenizer, card.
        assert commit.files == folder_files(out)
        assert set(commit.files) == expected_files()
        assert "refusion_hf" in commit.summary
        # The card passed the (stand-in's) metadata validation and carries the eval results.
        assert hub.validated_cards == [commit.files["README.md"].decode()]
        assert ModelCard(hub.validated_cards[0]).data.eval_results[0].metric_value == 0.55
        assert f"Pushed to {REPO_ID}: {hub.url}/{REPO_ID}/commit/" in stdout

        # Pushing again updates the existing repository (create_repo answers 409, exist_ok); nothing is stale.
        code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", out, "--overwrite", "--repo-id", REPO_ID, "--push")
        assert code == 0, err
        assert len(hub.commits) == 2 and set(hub.repos) == {REPO_ID} and hub.commits[1].other_operations == []
        assert set(hub.files[REPO_ID]) == expected_files() | {".gitattributes"}

        # A token the Hub rejects: one line naming the problem; nothing more was committed.
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", tmp_path / "again", "--repo-id", REPO_ID, "--push")
        assert_one_clear_error(code, err, "rejected (401 Unauthorized)", "hf auth login", "push it later")
        assert len(hub.commits) == 2 and (tmp_path / "again" / "README.md").is_file()


def test_push_replaces_the_model_files_of_an_earlier_push_and_keeps_the_rest(capsys, tmp_path, monkeypatch):
    """A repository that held a sharded model and an adapter: the new push must not leave a shard index, shards
    or an adapter config that `from_pretrained` would read beside the new weights; the user's own files stay."""
    earlier = {
        "model-00001-of-00002.safetensors": b"old shard",
        "model-00002-of-00002.safetensors": b"old shard",
        "model.safetensors.index.json": b"{}",
        "adapter_config.json": b"{}",
        "special_tokens_map.json": b"{}",
        "old_modeling.py": b"",
        "handler.py": b"# the owner's inference handler",
        "pytorch_model.bin": b"old weights",
        "custom_generate/old_helper.py": b"",
        "config.json": b"{}",
        "results.json": b"{}",
        "notes/eval[1].md": b"mine",
        "checkpoints/model.safetensors": b"mine too",
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    }
    with HubStandIn() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", hub.token)
        hub.repos[REPO_ID] = {"name": "tiny-refusion", "organization": "test-org", "type": "model"}
        hub.files[REPO_ID] = dict(earlier)
        out = tmp_path / "out"
        code, stdout, err = run_cli(capsys, "--model", FIXTURE, "--out", out, "--repo-id", REPO_ID, "--push")
        assert code == 0, err
        assert hub.unexpected == []
        stale = sorted(
            [
                "adapter_config.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "custom_generate/old_helper.py",
                "model.safetensors.index.json",
                "pytorch_model.bin",
                "special_tokens_map.json",
            ]
        )
        (commit,) = hub.commits
        assert sorted(op["value"]["path"] for op in commit.other_operations) == stale
        assert {op["key"] for op in commit.other_operations} == {"deletedFile"}
        kept = {"results.json", "notes/eval[1].md", "checkpoints/model.safetensors", ".gitattributes", "handler.py",
                "old_modeling.py"}  # fmt: skip
        assert hub.files[REPO_ID] == folder_files(out) | {name: earlier[name] for name in kept}
        assert f"deleted from {REPO_ID} the model files of an earlier push that this folder does not have: " in stdout
        assert ", ".join(stale) in stdout
        assert f"kept in {REPO_ID} files that are not part of the model: " in stdout
        assert "checkpoints/model.safetensors, handler.py, notes/eval[1].md, old_modeling.py, results.json" in stdout
        assert f"`hf repos delete-files {REPO_ID} PATH...`" in stdout


def test_push_without_token_is_one_clear_message(capsys, tmp_path, monkeypatch, no_token):
    with HubStandIn() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        out = tmp_path / "out"
        code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", out, "--repo-id", REPO_ID, "--push")
        assert_one_clear_error(code, err, "needs a Hugging Face access token", "hf auth login", "HF_TOKEN")
        assert "Nothing was written" in err and not out.exists()  # checked before the model is even loaded
        assert hub.requests == []  # nothing was sent

        # The Python API, given a finished folder: same message, pointing at the folder to upload later.
        run_cli(capsys, "--model", FIXTURE, "--out", out)
        with pytest.raises(PushError, match=re.escape(f"`hf upload {REPO_ID} {out} .`")):
            push_folder(out, REPO_ID)
        assert hub.requests == []


def test_push_without_network_is_one_clear_message(capsys, tmp_path, monkeypatch):
    with socket.socket() as probe:  # a loopback port with nobody listening
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", closed)
    monkeypatch.setenv("HF_TOKEN", "hf_some_token")
    code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", tmp_path / "out", "--repo-id", REPO_ID, "--push")
    assert_one_clear_error(code, err, f"could not reach the Hub at {closed}", "ConnectError", "network")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, _, err = run_cli(
        capsys, "--model", FIXTURE, "--out", tmp_path / "out", "--overwrite", "--repo-id", REPO_ID, "--push"
    )
    assert_one_clear_error(code, err, "HF_HUB_OFFLINE is set")


def _no_mask_checkpoint(tmp_path):
    folder = tmp_path / "no-mask"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["mask_token_id"]
    write_json(folder / "config.json", config)
    return folder


BAD_ARGUMENTS = [
    (["--push"], ["--push needs --repo-id"]),
    (["--repo-id", "tiny-refusion"], ["--repo-id 'tiny-refusion' has no namespace"]),
    (["--repo-id", "test-org/bad name"], ["--repo-id", "not a Hub repository id"]),
    (["--private"], ["--private only applies"]),
    (["--license", "Apache 2.0"], ["--license 'Apache 2.0'", "apache-2.0"]),
    (["--base-model", "TMPDIR"], ["--base-model", "local path"]),
    (["--dataset", "not a/valid id"], ["--dataset"]),
    (["--eval", "missing.json"], ["--eval missing.json: no such file", "refusion eval --json"]),
    (["--eval", "BROKEN_EVAL"], ["'refusion.tokens_per_second'"]),
    (["--block-size", "12", "--slot-size", "8"], ["--slot-size, --block-size", "multiple of `slot_size`"]),
    (["--block-size", "12"], ["(--block-size)", "multiple of `slot_size` (32)"]),  # the checkpoint's slot size
    (["--slot-threshold", "-1"], ["--slot-threshold", "expected a number >= 0, got -1"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens", "expected an integer >= 1, got 0"]),
    (["--tokenizer", "TMPDIR"], ["--tokenizer", "no tokenizer_config.json"]),
    (["--example-prompt", " "], ["--example-prompt"]),
]


@pytest.mark.parametrize("extra, fragments", BAD_ARGUMENTS, ids=[" ".join(args) for args, _ in BAD_ARGUMENTS])
def test_bad_arguments_fail_early_with_one_line(capsys, tmp_path, monkeypatch, extra, fragments):
    monkeypatch.chdir(tmp_path)
    broken = {**SYNTHETIC_EVAL, "refusion": {"accuracy": 0.5}}
    substitutions = {"BROKEN_EVAL": write_json(tmp_path / "broken.json", broken), "TMPDIR": tmp_path}
    extra = [substitutions.get(arg, arg) for arg in extra]
    code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", tmp_path / "out", *extra)
    assert_one_clear_error(code, err, *fragments)
    assert not (tmp_path / "out").exists()


def test_bad_sources_and_out_folders(capsys, tmp_path, monkeypatch):
    out = tmp_path / "out"
    cases = [
        (["--model", tmp_path / "nowhere/at/all"], ["--model", "no such folder"]),
        (["--model", _no_mask_checkpoint(tmp_path)], ["no mask_token_id", "refusion convert"]),
        (["--model", tmp_path / "no-mask" / "config.json"], ["is a file"]),
        (["--model", tmp_path], ["no config.json (model) or adapter_config.json"]),
    ]
    for args, fragments in cases:
        code, _, err = run_cli(capsys, *args, "--out", out)
        assert_one_clear_error(code, err, *fragments)
        assert not out.exists()

    # A Hub id cannot be fetched offline: one message, not a traceback from the download machinery.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code, _, err = run_cli(capsys, "--model", "test-org/not-cached", "--out", out)
    assert_one_clear_error(code, err, "--model test-org/not-cached", "downloading it from the Hub failed")

    # --out must not be the checkpoint itself, nor a non-empty folder unless --overwrite (which replaces it).
    code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", FIXTURE / "sub")
    assert_one_clear_error(code, err, "inside --model")
    out.mkdir()
    (out / "stale.bin").write_bytes(b"old")
    code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", out)
    assert_one_clear_error(code, err, "is not empty", "--overwrite")
    assert (out / "stale.bin").exists()
    code, _, _ = run_cli(capsys, "--model", FIXTURE, "--out", out, "--overwrite")
    assert code == 0 and set(folder_files(out)) == expected_files()  # the stale file is gone
    # --overwrite never deletes something that is not a published folder.
    (out / "project").mkdir()
    code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", out, "--overwrite")
    assert_one_clear_error(code, err, "has subfolders")
    monkeypatch.chdir(out)
    code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", ".", "--overwrite")
    assert_one_clear_error(code, err, "working or home directory")
    assert (out / "project").is_dir() and (out / "config.json").is_file()
    assert not [path for path in tmp_path.iterdir() if ".partial-" in path.name]  # no staging left behind


def test_eval_reports_of_other_weights_are_refused(capsys, tmp_path, inputs_dir):
    """A report records which weights it measured; publishing another model's numbers needs --allow-eval-mismatch."""
    other = json.loads((inputs_dir / "synthetic.json").read_text())
    other["settings"]["model_sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    del other["settings"]["model_sha256"]
    (tmp_path / "old.json").write_text(json.dumps(other))
    for report, message in (("other.json", "evaluated other weights"), ("old.json", "does not say which weights")):
        code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", tmp_path / "out", "--eval", tmp_path / report)
        assert_one_clear_error(code, err, message, "--allow-eval-mismatch")
        assert not (tmp_path / "out").exists()
    code, _, err = run_cli(
        capsys,
        "--model",
        FIXTURE,
        "--out",
        tmp_path / "out",
        "--eval",
        tmp_path / "other.json",
        "--allow-eval-mismatch",
    )
    assert code == 0, err


def test_a_real_eval_report_names_its_weights(capsys, tmp_path):
    report = tmp_path / "eval.json"
    assert main(["eval", "--model", str(FIXTURE), "--limit", "2", "--max-new-tokens", "4", "--slot-size", "4",
                 "--timing-repeats", "1", "--json", str(report)]) == 0  # fmt: skip
    code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", tmp_path / "out", "--eval", report)
    assert code == 0, err


def _link_out(folder, outside):
    (outside / "secret.jinja").write_text("{{ 'outside the folder' }}")
    (folder / "chat_template.jinja").symlink_to(outside / "secret.jinja")


def _fifo(folder, outside):
    import os

    os.mkfifo(folder / "chat_template.jinja")


def _tokenizer_code(folder, outside):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    write_json(folder / "tokenizer_config.json", {**config, "auto_map": {"AutoTokenizer": ["tok.Tok", None]}})
    (folder / "tok.py").write_text(f"open({str(outside / 'MARKER')!r}, 'w')\n")


def _corrupt_generation_config(folder, outside):
    (folder / "generation_config.json").write_text("{corrupt")


def _negative_vocabulary(folder, outside):
    write_json(folder / "config.json", {**json.loads((folder / "config.json").read_text()), "vocab_size": -5})


def _corrupt_adapter(folder, outside):
    for path in folder.iterdir():
        path.unlink()
    adapter = {"peft_type": "LORA", "base_model_name_or_path": REPO_ID, "r": 2, "target_modules": ["q_proj"]}
    write_json(folder / "adapter_config.json", adapter)
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")


BAD_SOURCES = {
    "link out of the folder": (_link_out, ["chat_template.jinja is a symbolic link to", "outside the folder"]),
    "fifo": (_fifo, ["chat_template.jinja is not a regular file"]),
    "tokenizer auto_map": (_tokenizer_code, ["names its own code in tokenizer_config.json", "tok.Tok"]),
    "corrupt generation config": (_corrupt_generation_config, ["generation_config.json is not readable JSON"]),
    "negative vocabulary": (_negative_vocabulary, ["vocab_size must be an integer >= 1, got -5"]),
    "corrupt adapter": (_corrupt_adapter, ["adapter_model.safetensors is not readable"]),
}


@pytest.mark.parametrize("name", list(BAD_SOURCES))
def test_sources_publish_cannot_copy_faithfully_are_refused_by_name(capsys, tmp_path, name):
    """publish copies the folder's own regular files, and refuses what it would publish differently from what the
    folder holds (code, a corrupt file it would skip), before writing anything."""
    source, outside = tmp_path / "model", tmp_path / "outside"
    shutil.copytree(FIXTURE, source)
    outside.mkdir()
    make, fragments = BAD_SOURCES[name]
    make(source, outside)
    code, _, err = run_cli(capsys, "--model", source, "--out", tmp_path / "out")
    assert_one_clear_error(code, err, *fragments)
    assert not (tmp_path / "out").exists() and not (outside / "MARKER").exists()


def test_a_link_to_a_file_inside_the_folder_is_published_as_that_file(capsys, tmp_path):
    source = tmp_path / "model"
    shutil.copytree(FIXTURE, source)
    (source / "store").mkdir()
    (source / "store" / "template.jinja").write_text("{{ 'inside the folder' }}")
    (source / "chat_template.jinja").symlink_to(source / "store" / "template.jinja")
    code, _, err = run_cli(capsys, "--model", source, "--out", tmp_path / "out")
    assert code == 0, err
    published = tmp_path / "out" / "chat_template.jinja"
    assert not published.is_symlink() and published.read_text() == "{{ 'inside the folder' }}"
