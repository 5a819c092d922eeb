"""The user docs (README.md, docs/*.md) cite only things that exist, and read as docs, not a work log.

- docs/config.md is what scripts/gen_config_docs.py renders from the pydantic schema today;
- every relative markdown link resolves to a file or folder in the repository, and its #anchor to a heading;
- every repository path a doc cites (a token whose first part is a top-level entry of the repository,
  such as `trainer/objectives.py`) exists;
- every `parity ...` command a doc shows names a real subcommand: `parity SUB [SERVICE] --help` exits 0;
- no commit hashes, and no headings that are dates or work periods ("Fourth round", "2026-11-25").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

# The repository's top-level folders: a cited path starting with one of them must exist. (Fixed, not read
# from disk: `runs/` and `.venv/` exist only where something was run.)
TOP_LEVEL = (
    ".ci",
    "bench",
    "broadcast",
    "clients",
    "commands",
    "docs",
    "examples",
    "infra",
    "parity",
    "protos",
    "requirements",
    "rollout",
    "scripts",
    "services",
    "tests",
    "trainer",
)
_PATH = re.compile(
    r"(?<![\w./=-])((?:" + "|".join(re.escape(t) for t in TOP_LEVEL) + r")/[\w./-]*)(?![\w*<{\[])"
)
# Only a token that names a file (an extension) or a folder (a trailing slash) is a path: `rollout/trainer`
# in prose means "rollout or trainer".
_PATH_LIKE = re.compile(r"(/|\.[A-Za-z]{1,5})$")
# Where a cited path may live: the repository root, or protos/ (protoc's import root: `parity/v1/x.proto`).
PATH_ROOTS = (ROOT, ROOT / "protos")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
# `parity SUB`, `.venv/bin/parity SUB`, `VAR=1 parity SUB`, `... && parity SUB` at the start of a command;
# not `kubectl -n parity get`, nor `parity settings:` in a log line.
_COMMAND = re.compile(
    r"(?:^|[;&|(]\s*|\$\s+|(?:^|\s)[A-Z_]+=\S*\s+)(?:[\w.]*/)*parity\s+([a-z][\w|-]*)(?![\w:-])"
    r"(?:\s+([a-z][\w|-]*))?",
    re.M,
)
# A commit hash: 7-40 hex digits with at least one letter and one digit, not a 0x number.
_HASH = re.compile(r"(?<![\w./#-])(?!0x)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
_DATE_HEADING = re.compile(
    r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}:\d{2}\b|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
    r"\s+(round|session)\b|\baddendum\b|\bround\s+\d+\b",
    re.I,
)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    text = _FENCE.sub("", _text(doc))
    headings = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc: Path) -> None:
    missing = []
    for target in _LINK.findall(_text(doc)):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (doc.parent / path) if path else doc
        broken_anchor = file.exists() and anchor and file.suffix == ".md" and anchor not in _anchors(file)
        if not file.exists() or broken_anchor:
            missing.append(target)
    assert not missing, f"{_rel(doc)}: links to missing files or headings: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_cited_repository_paths_exist(doc: Path) -> None:
    cited = {path.rstrip(".") for path in _PATH.findall(_text(doc))}
    missing = sorted(
        path
        for path in cited
        if _PATH_LIKE.search(path) and not any((base / path).exists() for base in PATH_ROOTS)
    )
    assert not missing, f"{_rel(doc)} cites paths that do not exist: {missing}"


def _shown_commands() -> dict[tuple[str, ...], set[str]]:
    """Every `parity SUB [SERVICE]` shown in a code block or inline code: argv -> docs showing it."""
    shown: dict[tuple[str, ...], set[str]] = {}
    for doc in DOCS:
        text = _text(doc)
        code = [block for block in _FENCE.findall(text)] + _INLINE.findall(_FENCE.sub("", text))
        for snippet in code:
            for sub, arg in _COMMAND.findall(snippet.strip()):
                for name in sub.split("|"):
                    argvs = [(name,)]
                    if name == "serve":
                        argvs = [(name, service) for service in (arg or "").split("|")]
                    for argv in argvs:
                        shown.setdefault(argv, set()).add(_rel(doc))
    return shown


def test_every_command_shown_has_working_help() -> None:
    shown = _shown_commands()
    assert ("run",) in shown, "the docs show no `parity run` at all: is the command pattern broken?"
    # One process calls the CLI's main(argv) for each command, so the whole check costs one start-up.
    script = (
        "import contextlib, io, json, sys\n"
        "from commands.main import main\n"
        "codes = {}\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    out = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):\n"
        "            code = main([*argv, '--help'])\n"
        "    except SystemExit as exc:\n"
        "        code = exc.code\n"
        "    codes[' '.join(argv)] = code if isinstance(code, int) else 1\n"
        "print(json.dumps(codes))\n"
    )
    argvs = sorted(shown)
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argvs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    codes = json.loads(result.stdout.strip().splitlines()[-1])
    failing = {
        f"parity {name} --help": sorted(shown[tuple(name.split())]) for name, code in codes.items() if code
    }
    assert not failing, f"commands shown in the docs whose --help fails (shown in): {failing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_commit_hashes(doc: Path) -> None:
    hashes = sorted(set(_HASH.findall(_text(doc))))
    assert not hashes, f"{_rel(doc)} cites commit hashes (history belongs in git): {hashes}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_work_log_headings(doc: Path) -> None:
    text = _FENCE.sub("", _text(doc))
    headings = [line for line in text.splitlines() if line.startswith("#") and _DATE_HEADING.search(line)]
    assert not headings, f"{_rel(doc)} has work-log headings (dates, rounds, sessions): {headings}"


def test_config_reference_is_current() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_config_docs
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert (ROOT / "docs" / "config.md").read_text() == gen_config_docs.render(), (
        "docs/config.md is stale: run `.venv/bin/python scripts/gen_config_docs.py`"
    )
