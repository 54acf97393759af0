"""process_exit: an entry point's status survives leaving without the interpreter's finalisation."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    ("None", 0, ""),
    ("SystemExit(3)", 3, ""),
    ("SystemExit('radixserve: cannot start: bad file')", 1, "radixserve: cannot start: bad file"),
]


@pytest.mark.parametrize(("raised", "code", "stderr"), CASES)
def test_status_and_message_are_kept_and_prints_are_flushed(raised: str, code: int, stderr: str) -> None:
    body = (
        "import sys\n"
        "from radixserve.process_exit import run_then_exit\n"
        "def main(x):\n"
        "    print('said', x, end='')\n"  # no newline, block-buffered into a pipe: only a flush shows it
        f"    e = {raised}\n"
        "    if e is not None:\n"
        "        raise e\n"
        "run_then_exit(main, 'it')\n"
        "print('never here')\n"
    )
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == code
    assert proc.stdout == "said it"
    assert proc.stderr.strip() == stderr


def test_an_unexpected_exception_keeps_its_traceback() -> None:
    body = ("from radixserve.process_exit import run_then_exit\n"
            "def main():\n    raise KeyError('boom')\n"
            "run_then_exit(main)\n")
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "KeyError: 'boom'" in proc.stderr


def test_before_exit_hooks_run_once_and_a_failing_one_changes_nothing() -> None:
    """What a thread half-did on disk is undone on the way out (weight_cache.abort_writes), though os._exit skips
    atexit; a hook that raises is logged, and the status stays the entry point's."""
    body = ("import sys\n"
            "from radixserve.process_exit import before_exit, run_then_exit\n"
            "def undo():\n    print('undone', end='')\n"
            "def broken():\n    raise OSError('disk gone')\n"
            "def main():\n    before_exit(broken)\n    before_exit(undo)\n    before_exit(undo)\n"
            "    raise SystemExit(143)\n"
            "run_then_exit(main)\n")
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 143
    assert proc.stdout == "undone"
    assert "a before-exit hook failed" in proc.stderr and "disk gone" in proc.stderr
