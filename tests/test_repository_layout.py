"""The repository seen from outside (issue 28's closing checks): the README is a quick start, modules stay small,
the embedded model's generated files say where they come from, and the documentation's relative links resolve.

They read files only (plus `git check-attr`), so the whole module takes well under a second.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "refusion_hf"
EMBEDDED_MODEL = PACKAGE / "assets" / "default_model"

README_MAX_LINES = 180
INSTALL_WITHIN_LINES = 40
MODULE_MAX_LINES = 500
# Packages whose every module must stay within MODULE_MAX_LINES: the core a newcomer reads first.
CORE_PACKAGES = ("generation", "modeling")
# Modules of other packages allowed over MODULE_MAX_LINES: the most lines they may have, and why.
OVERSIZED_MODULES = {
    "evaluation/sandbox.py": (
        660,
        "one security boundary: a 98-line docstring states each property with its escape test, next to the bwrap "
        "command line, the seccomp filter and the trusted runner (run inside the sandbox) that implement them",
    ),
    "hub_card/publish.py": (
        600,
        "building a Hub folder and pushing it share the managed-file rules (`_managed_patterns`); six input checks, "
        "each refusing by name before any heavy work",
    ),
}

GENERATED_HEADER = re.compile(
    r"^# Generated from (?P<source>refusion_hf(?:\.\w+)+) by (?P<generator>refusion_hf(?:\.\w+)+) .*"
    r"`make (?P<target>[\w-]+)`"
)
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _modules():
    return sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py") if "assets" not in path.parts)


def _line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def _generated_files():
    return sorted([*EMBEDDED_MODEL.glob("*.py"), *EMBEDDED_MODEL.glob("custom_generate/*.py")])


def _documents():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]


def _outside_fences(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _prose(text: str) -> str:
    """The text outside code: fenced blocks, indented blocks (after a blank line) and inline code spans dropped."""
    kept, in_indented_block, previous_blank = [], False, True
    for line in _outside_fences(text):
        in_indented_block = line.startswith("    ") and (previous_blank or in_indented_block)
        previous_blank = not line.strip()
        if not in_indented_block:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def _anchors(document: Path) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = [
        line.lstrip("#").strip() for line in _outside_fences(document.read_text()) if re.match(r"#{1,6} ", line)
    ]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def broken_links(document: Path) -> list[str]:
    """Every relative link of a markdown file whose file (or heading anchor) does not exist."""
    broken = []
    for match in MARKDOWN_LINK.finditer(_prose(document.read_text())):
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    return broken


def test_readme_is_a_quick_start():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail to docs/"
    install = next(number for number, line in enumerate(lines, 1) if "pip install" in line)
    assert install <= INSTALL_WITHIN_LINES, f"README.md's first `pip install` is on line {install}"


def test_readme_shows_the_commands_ci_and_the_demo_run():
    """.ci/run runs the README's test command; both that and `make demo` are Makefile targets."""
    ci_commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))
    ]
    assert ci_commands == ["make test"]
    readme_commands = {
        line.strip() for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("    ")
    }
    assert "make test" in readme_commands
    assert any(command.startswith("make demo") for command in readme_commands)
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert {"test", "demo"} <= targets


@pytest.mark.parametrize("module", _modules())
def test_module_size(module):
    lines = _line_count(PACKAGE / module)
    if module in OVERSIZED_MODULES:
        most, reason = OVERSIZED_MODULES[module]
        assert lines > MODULE_MAX_LINES, f"{module} ({lines} lines) is back within the limit: drop its exception"
        assert lines <= most, f"{module} has {lines} lines, over its exception's {most} ({reason})"
    else:
        assert lines <= MODULE_MAX_LINES, f"{module} has {lines} lines (at most {MODULE_MAX_LINES})"


def test_core_packages_have_no_size_exception():
    assert not [module for module in OVERSIZED_MODULES if module.split("/")[0] in CORE_PACKAGES]


@pytest.mark.parametrize("path", _generated_files(), ids=lambda path: path.relative_to(EMBEDDED_MODEL).as_posix())
def test_generated_file_names_its_source_and_how_to_regenerate_it(path):
    """The shipped copies themselves (tests/modeling/test_remote_code.py checks what save_pretrained writes)."""
    header = GENERATED_HEADER.match(path.read_text().splitlines()[0])
    assert header, f"{path.name} does not start with a '# Generated from ...' line"
    for module in (header["source"], header["generator"]):
        source = ROOT / "src" / Path(*module.split("."))
        assert source.with_suffix(".py").is_file() or (source / "__init__.py").is_file(), f"{module} does not exist"
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert header["target"] == "embedded-bundle" and header["target"] in targets


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_gitattributes_marks_the_generated_files():
    files = [path.relative_to(ROOT).as_posix() for path in _generated_files()]
    assert files
    report = subprocess.run(
        ["git", "check-attr", "linguist-generated", "--", *files], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    unmarked = [line for line in report if not line.endswith(": true") and not line.endswith(": set")]
    assert not unmarked


@pytest.mark.parametrize("document", _documents(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_resolve(document):
    assert not broken_links(document)


def test_link_check_finds_a_broken_link(tmp_path):
    """The checker itself: links in code are ignored, missing files and anchors are reported."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: yes\n")
    document = tmp_path / "page.md"
    document.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#a-code-heading-yes) [ok](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere)\n\n"
        "```\n[in a fence](fenced.md)\n```\n\n    [indented](indented.md)\n\n`[inline](inline.md)`\n"
    )
    assert broken_links(document) == ["missing.md", "other.md#nowhere"]
