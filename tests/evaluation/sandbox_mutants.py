"""Mutation check of the code sandbox: hand-made mutants of `src/refusion_hf/evaluation/sandbox.py`, each weakening
its isolation (or its verdict) in one place, run against the sandbox tests; every mutant must fail at least one test,
and a survivor is a missing test.

    PYTHONPATH=$PWD/src nice -n 10 .venv/bin/python tests/evaluation/sandbox_mutants.py \
        --json tests/evaluation/sandbox_mutants.json [--only NAME-SUBSTRING ...]

For each mutant the script writes the mutated module to a temporary folder and, in a child forked from one process
that has already imported pytest, torch and transformers (so a mutant costs its tests, not the imports), loads it as
`refusion_hf.evaluation.sandbox` and runs TEST_FILES. A mutant counts as killed only when a test's assertion fails
(an `assert`, or `pytest.fail`): the run stops there and the record names the test and the assertion. A test that
raises anything else, a setup, teardown or collection error, a run over MUTANT_TIMEOUT are reported apart ("errors
only", "timed out") and are not kills: they do not show that a test catches the weakening. `--json` writes the
record (command, commit, whether the tree was clean, machine, uid and date first; then the score and one entry per
mutant); the committed one is JSON_NAME. Run it as root (the tests whose unsandboxed half needs root run then) and,
for the normal-user score, as a normal user. `tests/evaluation/test_sandbox_mutants.py` checks, in a fraction of a
second, that every mutant still applies to the current source. Mutants listed in EQUIVALENT change nothing a program
can observe here, with the reason; they are run and reported but not counted.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "refusion_hf" / "evaluation" / "sandbox.py"
TEST_FILES = [  # the cheap kernel probe first: it kills the system-call mutants in about a second
    "tests/evaluation/test_sandbox_kernel.py",
    "tests/evaluation/test_sandbox.py",
    "tests/evaluation/test_verdict.py",
]
MUTANT_TIMEOUT = 300  # seconds; a suite still running then is reported as timed out (not a kill)
JSON_NAME = "tests/evaluation/sandbox_mutants.json"  # the committed record of the last full run
UNSHARE_ALL = '"--unshare-all",  # user, mount, pid, net, ipc, uts, cgroup'
DENIED_REGION = ("DENIED_SYSCALLS = (", ")  # fmt: skip")


@dataclass(frozen=True)
class Mutant:
    name: str
    edits: tuple[tuple[str, str], ...]  # (text found exactly once, its replacement)
    region: tuple[str, str] | None = None  # search only between these two markers

    def apply(self, source: str) -> str:
        start, end = 0, len(source)
        if self.region is not None:
            start = source.index(self.region[0])
            end = source.index(self.region[1], start)
        for old, new in self.edits:
            found = source.count(old, start, end)
            if found != 1:
                raise ValueError(f"mutant {self.name!r}: {old!r} found {found} times, expected once")
            at = source.index(old, start, end)
            source = source[:at] + new + source[at + len(old) :]
            end += len(new) - len(old)
        return source


def _namespaces_but(dropped: str) -> str:
    kept = [name for name in ("user", "pid", "net", "ipc", "uts", "cgroup") if name != dropped]
    return ", ".join(f'"--unshare-{name}"' for name in kept) + ","


def _drop(name: str, text: str) -> Mutant:
    return Mutant(name, ((text, ""),))


def _replace(name: str, old: str, new: str) -> Mutant:
    return Mutant(name, ((old, new),))


def _denied_syscalls(source: str) -> list[str]:
    start = source.index(DENIED_REGION[0])
    block = source[start : source.index(DENIED_REGION[1], start)]
    return [line.split('"')[1::2] for line in block.splitlines()[1:]]


def mutants(source: str | None = None) -> list[Mutant]:
    """The mutants; one per denied system call is generated from the current DENIED_SYSCALLS."""
    source = SOURCE.read_text() if source is None else source
    layout = "            *layout,\n"
    found = [
        # namespaces
        *[_replace(f"no {name} namespace", UNSHARE_ALL, _namespaces_but(name)) for name in ("pid", "net", "ipc")],
        _replace("no cgroup namespace", UNSHARE_ALL, _namespaces_but("cgroup")),
        Mutant("no UTS namespace", ((UNSHARE_ALL, _namespaces_but("uts")), ('"--hostname", "sandbox",', ""))),
        _drop("no --unshare-all (only a user namespace)", UNSHARE_ALL),
        _drop("nested user namespaces allowed (no --disable-userns)", '"--disable-userns",'),
        _drop("no --die-with-parent", '"--die-with-parent",'),
        _drop("no --new-session", '"--new-session",'),
        _drop("no --as-pid-1 (bwrap's init is process 1)", '"--as-pid-1",'),
        _drop("no --cap-drop ALL", '"--cap-drop", "ALL",'),
        _replace("root inside the user namespace", "SANDBOX_INNER_UID = 65534", "SANDBOX_INNER_UID = 0"),
        _replace("no uid switch (bwrap runs as the caller, root)", "    if os.geteuid() != 0:\n        return {}",
                 "    if True:\n        return {}"),  # fmt: skip
        _drop("environment not cleared", '"--clearenv",'),
        # the file system
        *[
            _replace(f"host {path} bound {how}", layout, f'{layout}            "--{flag}", "{path}", "{path}",\n')
            for path, flag, how in (
                ("/tmp", "bind", "read-write"), ("/tmp", "ro-bind", "read-only"), ("/home", "ro-bind", "read-only"),
                ("/etc", "ro-bind", "read-only"), ("/var/tmp", "bind", "read-write"), ("/run", "ro-bind", "read-only"),
                ("/opt", "ro-bind", "read-only"), ("/sys", "ro-bind", "read-only"),
            )
        ],  # fmt: skip
        _replace("the repository bound read-only", layout,
                 f'{layout}            "--ro-bind", {str(ROOT)!r}, {str(ROOT)!r},\n'),  # fmt: skip
        _replace("host /dev", '"--dev", "/dev",', '"--dev-bind", "/dev", "/dev",'),
        _replace("host /proc", '"--proc", "/proc",', '"--ro-bind", "/proc", "/proc",'),
        _replace("/usr writable", '["--ro-bind", "/usr", "/usr"]', '["--bind", "/usr", "/usr"]'),
        _replace("the program writable", '"--ro-bind-data", str(program_fd), _PROGRAM_PATH',
                 '"--bind-data", str(program_fd), _PROGRAM_PATH'),  # fmt: skip
        _drop("/ writable (an uncapped tmpfs)", '"--remount-ro", "/",'),
        _drop("/dev writable (an uncapped tmpfs)", '"--remount-ro", "/dev",'),
        _replace("/work 4x larger", "[work_dir, WORK_DIR_BYTES,", "[work_dir, 4 * WORK_DIR_BYTES,"),
        _replace("/dev/shm 4x larger", "[shm_dir, SHM_BYTES,", "[shm_dir, 4 * SHM_BYTES,"),
        _replace("WORK_DIR_BYTES 4x larger", "WORK_DIR_BYTES = 64 * 1024 * 1024", "WORK_DIR_BYTES = 256 * 1024 * 1024"),
        _replace("SHM_BYTES 4x larger", "SHM_BYTES = 16 * 1024 * 1024", "SHM_BYTES = 64 * 1024 * 1024"),
        _replace("/work 4x the inodes", "WORK_DIR_INODES], [", "4 * WORK_DIR_INODES], ["),
        _replace("/dev/shm 4x the inodes", "SHM_INODES]]", "4 * SHM_INODES]]"),
        _replace("WORK_DIR_INODES 4x", "WORK_DIR_INODES = 8192", "WORK_DIR_INODES = 32768"),
        _replace("SHM_INODES 4x", "SHM_INODES = 1024", "SHM_INODES = 4096"),
        _replace("tmpfs without an inode cap", "size={size},nr_inodes={inodes},mode=0755", "size={size},mode=0755"),
        _replace("bwrap's own tmpfs /work (no inode cap)", '"--bind", work_dir, "/work",',
                 '"--size", str(WORK_DIR_BYTES), "--tmpfs", "/work",'),
        _replace("bwrap's own tmpfs /dev/shm (no inode cap)", '"--bind", shm_dir, "/dev/shm",',
                 '"--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",'),
        _replace("/work without a size", "[work_dir, WORK_DIR_BYTES,", "[work_dir, 2**40,"),
        # the seccomp filter
        _drop("no seccomp filter", '"--seccomp", str(seccomp_fd),'),
        *[
            Mutant(f"{name} allowed", ((f'"{name}",', ""),), region=DENIED_REGION)
            for line in _denied_syscalls(source)
            for name in line
        ],
        _replace("clone3 allowed", 'UNAVAILABLE_SYSCALLS = ("clone3",)', "UNAVAILABLE_SYSCALLS = ()"),
        _replace("clone with namespace flags allowed", "for flag in clone_flags:\n", "for flag in []:\n"),
        _drop("F_SETPIPE_SZ allowed",
              'rules.add_rule(EPERM, "fcntl", seccomp.Arg(1, seccomp.MASKED_EQ, INT, set_pipe_size))'),  # fmt: skip
        _replace("F_SETPIPE_SZ compared on 64 bits", "seccomp.Arg(1, seccomp.MASKED_EQ, INT, set_pipe_size)",
                 "seccomp.Arg(1, seccomp.EQ, set_pipe_size)"),  # fmt: skip
        _replace("socket buffers may grow", "for option in buffer_options:\n", "for option in []:\n"),
        _replace("SO_SNDBUFFORCE allowed", '"SO_SNDBUFFORCE": 32, ', ""),
        _replace("SO_RCVBUF allowed", '"SO_RCVBUF": 8, ', ""),
        _replace("setsockopt compared on 64 bits", "seccomp.Arg(2, seccomp.MASKED_EQ, INT, option)",
                 "seccomp.Arg(2, seccomp.EQ, option)"),  # fmt: skip
        _replace("every socket family allowed", 'for call in ("socket", "socketpair"):\n', "for call in ():\n"),
        _replace("AF_PACKET allowed", 'SOCKET_FAMILIES = {"AF_UNIX": 1,', 'SOCKET_FAMILIES = {"AF_PACKET": 17,'
                 ' "AF_UNIX": 1,'),  # fmt: skip
        _replace("every netlink protocol allowed", "rules.add_rule(REFUSED_FAMILY, call, family_arg, seccomp.Arg(2, "
                 "seccomp.NE, protocol_route))", "pass"),  # fmt: skip
        _drop("families above the allowed ones allowed",
              "rules.add_rule(REFUSED_FAMILY, call, seccomp.Arg(0, seccomp.GT, top))"),  # fmt: skip
        # limits
        _replace("4x the processes", 'f"--nproc={processes}",', 'f"--nproc={4 * processes}",'),
        _replace("the whole memory per process", "memory_bytes=memory_limit_mb * 2**20 // max_processes,",
                 "memory_bytes=memory_limit_mb * 2**20,"),  # fmt: skip
        _replace("4x the address space", 'f"--as={memory_bytes}",', 'f"--as={4 * memory_bytes}",'),
        _replace("CPU seconds + 60", "cpu_seconds=int(timeout) + 1,", "cpu_seconds=int(timeout) + 61,"),
        _replace("16x the file size", 'f"--fsize={OUTPUT_LIMIT_BYTES}",', 'f"--fsize={16 * OUTPUT_LIMIT_BYTES}",'),
        _replace("OUTPUT_LIMIT_BYTES 16x", "OUTPUT_LIMIT_BYTES = 1024 * 1024", "OUTPUT_LIMIT_BYTES = 16 * 1024 * 1024"),
        _replace("OPEN_FILES_LIMIT 4096", "OPEN_FILES_LIMIT = 64", "OPEN_FILES_LIMIT = 4096"),
        _drop("core dumps allowed", '"--core=0",'),
        _replace("no wall-time limit (10x)", "returncode = process.wait(timeout=timeout)",
                 "returncode = process.wait(timeout=10 * timeout)"),  # fmt: skip
        # the verdict (the judge's record)
        _replace("judge's record not read", "verdict = _read_verdict(evidence_path, nonce)", 'verdict = (True, "")'),
        _replace("exit status alone", "outcome.returncode == 0 and outcome.verdict is not None and outcome.verdict[0]",
                 "outcome.returncode == 0"),
        _replace("any nonce accepted", 'set(record) != {"nonce", "passed", "detail"} or record["nonce"] != nonce:',
                 'set(record) != {"nonce", "passed", "detail"}:'),
    ]  # fmt: skip
    return found


EQUIVALENT = {  # mutant name: why no program can tell the difference here
    "environment not cleared": "bwrap is started with an environment of PATH alone, which --setenv sets anyway",
}


KILLED, ERRORS, TIMED_OUT, SURVIVED = "killed", "errors only", "timed out", "survived"


def run_mutant(mutant: Mutant, folder: Path, log: Path) -> dict:
    """Fork; in the child load the mutated module and run the tests. Returns {"outcome": KILLED (a test's assertion
    failed: `by` names it), ERRORS (no assertion failed, but a test raised something else, or setup, teardown or
    collection failed: `errors` lists the first few), TIMED_OUT (over MUTANT_TIMEOUT s) or SURVIVED, "seconds"}."""
    for sibling in SOURCE.parent.glob("*.py"):  # files sandbox.py reads next to itself (verdict_runner.py)
        if sibling != SOURCE:
            (folder / sibling.name).write_bytes(sibling.read_bytes())
            (folder / sibling.name).chmod(0o644)
    mutated = folder / "sandbox.py"
    mutated.write_text(mutant.apply(SOURCE.read_text()))
    mutated.chmod(0o644)
    report = folder / "report.json"
    report.unlink(missing_ok=True)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 3
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = _child(mutated, report)
        finally:
            os._exit(code)
    deadline = start + MUTANT_TIMEOUT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return {"outcome": TIMED_OUT, "seconds": round(time.monotonic() - start, 1)}
        time.sleep(0.2)
    seconds = round(time.monotonic() - start, 1)
    if not report.exists():
        code = os.waitstatus_to_exitcode(status)
        return {"outcome": ERRORS, "errors": [f"the harness's child ended with {code} (see {log})"], "seconds": seconds}
    return {**json.loads(report.read_text()), "seconds": seconds}


def _child(mutated: Path, report: Path) -> int:
    import importlib.util

    import pytest

    import refusion_hf.evaluation as evaluation

    spec = importlib.util.spec_from_file_location("refusion_hf.evaluation.sandbox", mutated)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    evaluation.sandbox = module
    found = {"by": None, "errors": []}

    class Classify:  # a pytest plugin: the first assertion that fails ends the run; anything else is an error
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item, call):
            outcome = yield
            if call.excinfo is None or call.excinfo.errisinstance(pytest.skip.Exception):
                return
            said = " ".join(outcome.get_result().longreprtext.split("\n")[-1:])[:160] or call.excinfo.typename
            assertion = call.excinfo.errisinstance((AssertionError, pytest.fail.Exception))
            if call.when == "call" and assertion and found["by"] is None:
                found["by"] = f"{item.nodeid}: {call.excinfo.exconly().splitlines()[0][:160]}"
                item.session.shouldstop = "an assertion failed: the mutant is killed"
            elif not assertion or call.when != "call":
                found["errors"].append(f"{item.nodeid} ({call.when}): {call.excinfo.typename}: {said}")

        def pytest_collectreport(self, report):
            if report.failed:
                found["errors"].append(f"collecting {report.nodeid}: {report.longreprtext.splitlines()[-1][:160]}")

    code = int(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *TEST_FILES],
                           plugins=[Classify()]))  # fmt: skip
    if found["by"] is not None:
        result = {"outcome": KILLED, "by": found["by"]}
    elif found["errors"] or code not in (0, 5):
        result = {"outcome": ERRORS, "errors": found["errors"][:5] or [f"pytest exit {code}"]}
    else:
        result = {"outcome": SURVIVED}
    report.write_text(json.dumps(result))
    return 0


def provenance(argv: list[str]) -> dict:
    """Where the score comes from: command, commit and whether the tree was clean, machine, user, date."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    model = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    return {
        "command": shlex.join(["python", str(Path(argv[0]).resolve().relative_to(ROOT)), *argv[1:]]),
        "commit": git("rev-parse", "HEAD"),
        "tree_clean": not [line for line in git("status", "--porcelain").splitlines() if JSON_NAME not in line],
        "machine": {
            "cpu": model[1].strip() if model else platform.processor(),
            "cpu_vector_flags": sorted(
                f for f in (flags[1].split() if flags else []) if re.match(r"avx2$|avx512|amx", f)
            ),
            "cpu_count": os.cpu_count(),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "os": platform.platform(),
            "python": platform.python_version(),
            "bwrap": subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip(),
        },
        "uid": os.geteuid(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="run the mutants whose name contains this (repeatable)")
    parser.add_argument("--json", type=Path, help=f"write the record here (the committed one: {JSON_NAME})")
    args = parser.parse_args(argv)
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    if "refusion_hf.evaluation.sandbox" in sys.modules:
        raise SystemExit("the sandbox module is already imported: run this script directly")
    import pytest  # noqa: F401 - imported once here, inherited by every forked child
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import refusion_hf  # noqa: F401
    import tests.conftest  # noqa: F401

    record = {"provenance": provenance(command)}
    selected = [m for m in mutants() if args.only is None or any(part in m.name for part in args.only)]
    results = []
    with tempfile.TemporaryDirectory(prefix="refusion-mutants-") as folder:
        os.chmod(folder, 0o755)  # a test loads the mutated module as another (unprivileged) user
        logs = Path(tempfile.mkdtemp(prefix="refusion-mutant-logs-"))
        baseline = run_mutant(Mutant("unmutated", ()), Path(folder), logs / "unmutated.log")
        if baseline["outcome"] != SURVIVED:  # the harness itself is broken: every mutant would look killed
            raise SystemExit(f"the unmutated sandbox fails its tests in this harness: {baseline}")
        for index, mutant in enumerate(selected):
            result = {"mutant": mutant.name, **run_mutant(mutant, Path(folder), logs / f"{index:03d}.log")}
            result["equivalent"] = EQUIVALENT.get(mutant.name)
            results.append(result)
            said = result.get("by") or "; ".join(result.get("errors", []))[:200]
            print(f"{mutant.name:55s} {result['outcome']}: {said}  [{result['seconds']:.0f} s]", flush=True)
    counted = [r for r in results if not r["equivalent"]]
    tally = {
        kind: [r["mutant"] for r in counted if r["outcome"] == kind] for kind in (KILLED, ERRORS, TIMED_OUT, SURVIVED)
    }
    score = {
        "killed": len(tally[KILLED]),
        "counted": len(counted),
        "errors_only": tally[ERRORS],
        "timed_out": tally[TIMED_OUT],
        "survived": tally[SURVIVED],
        "equivalent_not_counted": [r["mutant"] for r in results if r["equivalent"]],
        "killed_by_file": dict(collections.Counter(r["by"].split("::")[0] for r in counted if r["outcome"] == KILLED)),
    }
    print(f"\nmutation score: {score['killed']} / {score['counted']} killed by an assertion; errors only: "
          f"{tally[ERRORS] or 'none'}; timed out: {tally[TIMED_OUT] or 'none'}; survived: {tally[SURVIVED] or 'none'}; "
          f"{len(results) - len(counted)} equivalent not counted; logs in {logs}")  # fmt: skip
    if args.json is not None:
        record.update(score=score, results=results)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if score["killed"] == score["counted"] else 1


if __name__ == "__main__":
    sys.exit(main())
