"""`refusion publish` never copies content from outside the model folder (`hub_card/own_files.py`), through the real
CLI: a chat template planted at depth 2 (`additional_chat_templates/`, which the tokenizer reads and saves) as a
symbolic link leaving the folder, a relative link through `..`, a symbolic link to a directory outside, and a hard
link to a file outside. Each is first shown to publish the outside secret when the check is switched off; with it,
the command fails with one line naming the file, and nothing but the source and the outside folder is left (no
published folder, no staging folder). A link or hard link whose names are all inside the folder publishes as that
file; a full disk leaves no half-written folder."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys

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


def test_a_mount_point_inside_the_folder_is_refused(tmp_path):
    """Another file system (a tmpfs) mounted into the folder, in a mount namespace of its own."""
    source = tmp_path / "model"
    shutil.copytree(FIXTURE, source)
    (source / TEMPLATES).mkdir()
    mount = ["-t", "tmpfs", "-o", "size=64k", "tmpfs", source / TEMPLATES]
    ran = _publish_under_a_mount(mount, True, "--model", source, "--out", tmp_path / "out")
    assert_one_clear_error(ran.returncode, ran.stderr, f"--model {source}: {TEMPLATES} is a mount point")
    assert sorted(os.listdir(tmp_path)) == ["model"]


def _chat_template_loop(source):
    (source / "chat_template.jinja").symlink_to("chat_template.jinja")


def _two_link_loop(source):
    (source / "chat_template.jinja").symlink_to("other.jinja")
    (source / "other.jinja").symlink_to("chat_template.jinja")


def _link_to_nothing(source):
    (source / "chat_template.jinja").symlink_to("templates/missing.jinja")


NOWHERE = {  # name -> (plant it, what the error line says)
    "a link to itself": (_chat_template_loop, "chat_template.jinja is a loop of symbolic links (chat_template.jinja)"),
    "two links to each other": (_two_link_loop, "chat_template.jinja is a loop of symbolic links (other.jinja)"),
    "a link to nothing": (_link_to_nothing, "chat_template.jinja is a link to nothing (templates/missing.jinja)"),
}


@pytest.mark.parametrize("name", list(NOWHERE))
def test_a_link_that_leads_nowhere_is_refused_not_dropped(capsys, tmp_path, monkeypatch, name):
    """A `chat_template.jinja` that is a loop of symbolic links (or a link to nothing) is dropped silently by the
    tokenizer's loader (shown with the check switched off: published without a chat template); publish refuses it
    in one line."""
    for checked in (False, True):
        source, out = tmp_path / f"model-{checked}", tmp_path / f"out-{checked}"
        shutil.copytree(FIXTURE, source)
        NOWHERE[name][0](source)
        with monkeypatch.context() as patch:
            if not checked:
                patch.setattr(PUBLISH, "check_own_files", lambda folder, flag: None)
            code, _, err = run_cli(capsys, "--model", source, "--out", out)
        if not checked:
            assert code == 0 and not (out / "chat_template.jinja").exists(), "dropped silently without the check"
        else:
            assert_one_clear_error(code, err, f"--model {source}: {NOWHERE[name][1]}", "remove it or put the file")
            assert not out.exists()


# Runs `refusion publish` (through `refusion_hf.cli.main`) after `mount MOUNT_ARGUMENTS`, in a private mount
# namespace of its own (a user namespace too when not root): nothing is mounted on the host. argv: MOUNT_ARGUMENTS
# (JSON) CHECK then publish's arguments; CHECK=0 switches the check off.
PUBLISH_UNDER_A_MOUNT = """
import importlib, json, subprocess, sys
mount, check, *arguments = sys.argv[1:]
subprocess.run(["mount", *json.loads(mount)], check=True)
if check == "0":
    importlib.import_module("refusion_hf.hub_card.publish").check_own_files = lambda folder, flag: None
from refusion_hf.cli import main
sys.exit(main(["publish", *arguments]))
"""


def _publish_under_a_mount(mount, checked, *arguments):
    namespace = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        namespace[1:1] = ["--user", "--map-root-user"]
    command = [*namespace, sys.executable, "-c", PUBLISH_UNDER_A_MOUNT, json.dumps(list(map(str, mount)))]
    command += ["1" if checked else "0", *map(str, arguments)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_bind_mount_inside_the_folder_is_refused(tmp_path, kind):
    """A bind mount of an outside file onto `chat_template.jinja`, or of an outside directory onto
    `additional_chat_templates/`, within the folder's own file system (same device: `os.path.ismount` misses both)
    publishes the outside content when the check is off; publish refuses it in one line, from the kernel's mount
    table."""
    outside = tmp_path / "outside"
    secret = _secret(outside.mkdir() or outside)
    for checked in (False, True):
        source, out = tmp_path / f"model-{checked}", tmp_path / f"out-{checked}"
        shutil.copytree(FIXTURE, source)
        (source / "chat_template.jinja").write_text(DEFAULT_TEMPLATE)
        if kind == "file":
            mounted, destination, relative = secret, source / "chat_template.jinja", "chat_template.jinja"
        else:
            (source / TEMPLATES).mkdir()
            mounted, destination, relative = secret.parent, source / TEMPLATES, TEMPLATES
        assert os.stat(mounted).st_dev == os.stat(source).st_dev, "one file system"
        ran = _publish_under_a_mount(["--bind", mounted, destination], checked, "--model", source, "--out", out)
        if not checked:
            assert ran.returncode == 0, ran.stderr[-2000:]
            assert _files_holding_the_secret(out), "without the check, the outside secret is published"
        else:
            assert_one_clear_error(ran.returncode, ran.stderr, f"--model {source}: {relative} is a mount point")
            assert not out.exists()
