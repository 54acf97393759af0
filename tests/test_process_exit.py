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
