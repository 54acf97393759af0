"""The README and docs/ say only what is true: every file they name exists, every `radixserve` command
they show parses against the real command line (serve / generate flags are ServerArgs fields; each bench
takes its own flags), and the commands a newcomer runs first really run and answer.

Commands that need what this machine may lack (llama.cpp binaries, a second machine, an hour) are
parsed, not run; placeholders in them (PATH, FILE.gguf, $VAR) are only strings to the parser.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.entrypoints.cli import BENCHMARKS, build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


def _documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every `radixserve ...` line of a bash block and every inline `radixserve ...` span."""
    found: list[tuple[str, str]] = []
    for page in PAGES:
        text = _text(page)
        for block in _code_blocks(text, "bash"):
            joined = block.replace("\\\n", " ")
            for line in joined.split("\n"):
                line = line.split(" #", 1)[0].strip()
                for part in re.split(r"\s*(?:&&|;|\|(?!\S*\|)\s)\s*", line):
                    m = re.match(r"^(?:\S*/)?radixserve\s+(.*?)\s*&?$", part)
                    if m:
                        found.append((page.name, m.group(1)))
        # inline spans with arguments (a bare "`radixserve inspect`" names the tool, it is no command)
        for span in re.findall(r"`((?:\S*/)?radixserve (?:serve|generate|bench|inspect) [^`]*)`", text):
            found.append((page.name, span.split(" ", 1)[1]))
    return found


def _argv(command: str) -> list[str]:
    """A documented command as argv: optional parts ([--flag v]) kept, `a|b` alternatives take the first."""
    command = command.replace("[", " ").replace("]", " ").replace("...", " ")
    argv = []
    for tok in shlex.split(command):
        if "|" in tok and not tok.startswith(("'", '"')) and "://" not in tok:
            tok = tok.split("|")[0]
        if tok:
            argv.append(tok)
    return argv


COMMANDS = _documented_commands()


def test_the_docs_show_commands_at_all():
    # the extraction itself can fail silently (a changed fence): the README alone shows several
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_every_documented_command_parses(page: str, command: str):
    argv = _argv(command)
    assert argv, command
    if argv[0] == "bench":
        name = argv[1]
        assert name.replace("_", "-") in BENCHMARKS, f"{page}: unknown benchmark {name!r} in {command!r}"
        module = importlib.import_module(f"radixserve.bench.{BENCHMARKS[name.replace('_', '-')]}")
        rest = argv[2:]
        if "--" in rest:  # serving-peer passes what follows `--` to `bench serving`
            i = rest.index("--")
            importlib.import_module("radixserve.bench.serving").build_parser().parse_args(rest[i + 1:])
            rest = rest[:i]
        try:
            module.build_parser().parse_args(rest)
        except SystemExit as e:
            if e.code not in (0, None):  # --help exits 0
                pytest.fail(f"{page}: `radixserve {command}` does not parse (exit {e.code})")
        return
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            pytest.fail(f"{page}: `radixserve {command}` does not parse (exit {e.code})")


def test_every_named_file_exists():
    missing = []
    for page in PAGES:
        text = _text(page)
        for ref in set(re.findall(r"`((?:tests|radixserve|scripts|docs|shared)/[\w./-]+)", text)):
            ref = ref.rstrip(".").split("::")[0]
            if ref.startswith("shared/"):
                continue  # the project's shared folder lives beside the checkout, not in it
            if not (ROOT / ref).exists():
                missing.append(f"{page.name}: {ref}")
        for link in re.findall(r"\]\(([^)#]+)\)", text):
            if "://" in link:
                continue
            if not (page.parent / link).exists():
                missing.append(f"{page.name}: link {link}")
    assert not missing, "\n".join(missing)


def test_readme_is_a_front_page():
    text = _text(ROOT / "README.md")
    assert text.count("\n") < 250
    first = _code_blocks(text, "bash")[0].strip().split("\n")
    assert [line.split()[:2] for line in first] == [["make", "serve"], ["make", "test"]]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kw)


def test_the_readme_engine_example_answers():
    """A newcomer's first offline example, as printed, gives text and a finish reason."""
    blocks = [b for b in _code_blocks(_text(ROOT / "README.md"), "python") if "radixserve.Engine()" in b]
    assert blocks, "the README shows no Engine example"
    code = blocks[0] + '\nassert out["text"] and out["meta_info"]["finish_reason"]\nassert len(outs) == 2\n'
    r = _run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "finish_reason" in r.stdout


def test_the_debugging_commands_run(tmp_path):
    """docs/web_page.md's first block: generate with a trace and invariant checks, then inspect the trace."""
    block = _code_blocks(_text(ROOT / "docs" / "web_page.md"), "bash")[0]
    lines = [line.strip() for line in block.strip().split("\n")]
    trace = str(tmp_path / "steps.jsonl")
    for line in lines:
        argv = _argv(line.split(" ", 1)[1].replace("/tmp/steps.jsonl", trace))
        r = _run([sys.executable, "-m", "radixserve.entrypoints.cli", *argv])
        assert r.returncode == 0, (line, r.stderr[-3000:])
    assert Path(trace).stat().st_size > 0
    assert "DECODE" in r.stdout or "decode" in r.stdout.lower(), r.stdout[:2000]
