"""`refusion publish` never copies content from outside the model folder (`hub_card/own_files.py`), through the real
CLI: a chat template planted at depth 2 (`additional_chat_templates/`, which the tokenizer reads and saves) as a
symbolic link leaving the folder, a relative link through `..`, a symbolic link to a directory outside, and a hard
link to a file outside. Each is first shown to publish the outside secret when the check is switched off; with it,
the command fails with one line naming the file, and nothing but the source and the outside folder is left (no
published folder, no staging folder). A link or hard link whose names are all inside the folder publishes as that
file; a full disk leaves no half-written folder."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess

import pytest
from safetensors import SafetensorError
from transformers import modeling_utils

from .conftest import FIXTURE
from .test_publish_cli import assert_one_clear_error, run_cli

PUBLISH = importlib.import_module("refusion_hf.hub_card.publish")  # the package's `publish` is the function
SECRET = "secret-7c1f outside the folder"
TEMPLATES = "additional_chat_templates"
DEFAULT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # the source's own


def _secret(outside):
    (outside / "templates").mkdir()
    path = outside / "templates" / "x.jinja"
    path.write_text("{{ '" + SECRET + "' }}")
    return path


def _link_at_depth_2(source, outside):
    (source / TEMPLATES).mkdir()
    (source / TEMPLATES / "x.jinja").symlink_to(_secret(outside))


def _relative_link_through_parent(source, outside):
    (source / TEMPLATES).mkdir()
    _secret(outside)
    (source / TEMPLATES / "x.jinja").symlink_to(os.path.join("..", "..", outside.name, "templates", "x.jinja"))


def _linked_directory(source, outside):
    (source / TEMPLATES).symlink_to(_secret(outside).parent, target_is_directory=True)


def _hard_link(source, outside):
    (source / TEMPLATES).mkdir()
    os.link(_secret(outside), source / TEMPLATES / "x.jinja")


# name -> (plant it in the source folder, what the error line says)
LEAKS = {
    "link at depth 2": (_link_at_depth_2, [f"{TEMPLATES}/x.jinja is a symbolic link to", "outside the folder"]),
    "link through ..": (_relative_link_through_parent, [f"{TEMPLATES}/x.jinja is a symbolic link to", "outside the"]),
    "linked directory": (_linked_directory, [f"{TEMPLATES} is a symbolic link to", "outside the folder"]),
    "hard link": (_hard_link, [f"{TEMPLATES}/x.jinja is a hard link: the file has 2 names, 1 of them outside the",
                               f"cp {TEMPLATES}/x.jinja"]),
}  # fmt: skip


def _planted(tmp_path, name):
    source, outside = tmp_path / "model", tmp_path / "outside"
    shutil.copytree(FIXTURE, source)
    (source / "chat_template.jinja").write_text(DEFAULT_TEMPLATE)  # an additional template needs a default one
    outside.mkdir()
    LEAKS[name][0](source, outside)
    return source


def _files_holding_the_secret(folder) -> list[str]:
    return [str(path) for path in folder.rglob("*") if path.is_file() and SECRET.encode() in path.read_bytes()]


@pytest.mark.parametrize("name", list(LEAKS))
def test_without_the_check_the_planted_file_is_published(capsys, tmp_path, monkeypatch, name):
    """The leak is real: the tokenizer reads the planted template through the link and saves it into --out."""
    source = _planted(tmp_path, name)
    monkeypatch.setattr(PUBLISH, "check_own_files", lambda folder, flag: None)
    code, _, err = run_cli(capsys, "--model", source, "--out", tmp_path / "out")
    assert code == 0, err
    assert _files_holding_the_secret(tmp_path / "out"), "the outside secret was published"


@pytest.mark.parametrize("name", list(LEAKS))
def test_content_from_outside_the_folder_is_refused(capsys, tmp_path, name):
    source = _planted(tmp_path, name)
    code, _, err = run_cli(capsys, "--model", source, "--out", tmp_path / "out")
    assert_one_clear_error(code, err, f"--model {source}: ", *LEAKS[name][1])
    assert sorted(os.listdir(tmp_path)) == ["model", "outside"], "no published folder, no staging folder"


def test_links_and_hard_links_inside_the_folder_publish_as_their_file(capsys, tmp_path):
    source = tmp_path / "model"
    shutil.copytree(FIXTURE, source)
    (source / "chat_template.jinja").write_text(DEFAULT_TEMPLATE)
    (source / "store").mkdir()
    (source / "store" / "a.jinja").write_text("{{ 'template a, inside' }}")
    (source / "store" / "b.jinja").write_text("{{ 'template b, inside' }}")
    (source / TEMPLATES).mkdir()
    os.link(source / "store" / "a.jinja", source / TEMPLATES / "a.jinja")  # two names, both in the folder
    (source / TEMPLATES / "b.jinja").symlink_to(os.path.join("..", "store", "b.jinja"))
    code, _, err = run_cli(capsys, "--model", source, "--out", tmp_path / "out")
    assert code == 0, err
    published = tmp_path / "out" / TEMPLATES
    assert (published / "a.jinja").read_text() == "{{ 'template a, inside' }}"
    assert not (published / "b.jinja").is_symlink()
    assert (published / "b.jinja").read_text() == "{{ 'template b, inside' }}"


def test_a_full_disk_leaves_no_published_folder(capsys, tmp_path, monkeypatch):
    def full_disk(state, path, *args, **kwargs):
        with open(path, "wb") as handle:
            handle.write(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "--model", FIXTURE, "--out", out)
    assert_one_clear_error(code, err, f"--out {out}: writing it failed (Error while serializing: I/O error: No space")
    assert os.listdir(tmp_path) == [], "no published folder, no staging folder"


def test_a_mount_point_inside_the_folder_is_refused(capsys, tmp_path):
    """Another file system mounted into the folder (as a bind mount of a host directory would be); root only."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    source = tmp_path / "model"
    shutil.copytree(FIXTURE, source)
    (source / TEMPLATES).mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(source / TEMPLATES)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        code, _, err = run_cli(capsys, "--model", source, "--out", tmp_path / "out")
    finally:
        subprocess.run(["umount", str(source / TEMPLATES)], check=True)
    assert_one_clear_error(code, err, f"--model {source}: {TEMPLATES} is a mount point")
    assert sorted(os.listdir(tmp_path)) == ["model"]
