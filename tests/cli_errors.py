"""The user-error convention of the `refusion` commands, as tests check it."""

from refusion_hf.cli import main


def user_error(capsys, argv) -> str:
    """Run `refusion ARGV`; it must fail as a user error (status 2, one line, no traceback). Returns the message."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("note:", "Loading"))]
    assert code == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    prefix = f"refusion {argv[0]}: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0][len(prefix) :]
