"""The repository speaks of what quantkit does, not of how it was produced: no file (code, comments,
docs, tests, result names) refers to the work that made it, tracker numbers, borrowed machines or the
paths of the machines it was built on. History belongs in git."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The one list of forbidden patterns (case-insensitive). Each names what it catches.
FORBIDDEN = {
    "work session": r"\b(work |this |next |earlier |previous |\w+th |\d+(st|nd|rd|th) )?sessions?\b",
    "issue number": r"\b(issue|task|ticket)s?\s*#?\s*\d+",
    "helper agent": r"\b(the|a|my|our) helpers?\b|\bsub-?agents?\b",
    "borrowed machine": r"\blent\b|\blease[ds]?\b|device (call|tool|time|budget)",
    "machine-local path": r"(?<![\w~.])/(root|work)/|\.device-stage",
    "review round": r"\breviewers? (said|asked)|\bcode review\b",
}
# Legitimate uses of the same letters: pytest's fixture scope.
ALLOWED = [r"""scope=["']session["']""", r"pytest session", r"session-scoped"]

TEXT_SUFFIXES = {".py", ".md", ".txt", ".yaml", ".yml", ".toml", ".cfg", ".sh", ".cu", ".cuh", ".cpp", ".h", ".json",
                 ".ini", ""}


def tracked_files():
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in listed if name and (REPO / name).is_file()]


def offences(text):
    for allowed in ALLOWED:
        text = re.sub(allowed, "", text, flags=re.IGNORECASE)
    for what, pattern in FORBIDDEN.items():
        for match in re.finditer(pattern, text, flags=re.IGNORECASE):
            yield what, match.group(0)


def test_patterns_catch_what_they_name():
    assert dict(offences("measured in the 3rd session")) == {"work session": "3rd session"}
    assert list(offences("see issue 8 and task 12"))[0][0] == "issue number"
    assert list(offences("the helper ran it"))[0][0] == "helper agent"
    assert list(offences("on a lent GPU"))[0][0] == "borrowed machine"
    assert list(offences("cached in /root/.cache"))[0][0] == "machine-local path"
    assert not list(offences('@pytest.fixture(scope="session")'))
    assert not list(offences("the GPTQ reference's helper functions are not used"))


def test_no_file_names_or_text_refer_to_how_the_project_was_produced():
    found = []
    for path in tracked_files():
        rel = path.relative_to(REPO).as_posix()
        for what, word in offences(rel):
            found.append(f"{rel}: file name: {what} ({word!r})")
        if path.suffix not in TEXT_SUFFIXES or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if path == Path(__file__):
            text = text.split("FORBIDDEN = {", 1)[0]  # the list itself, and its self-test below
        for lineno, line in enumerate(text.splitlines(), 1):
            for what, word in offences(line):
                found.append(f"{rel}:{lineno}: {what} ({word!r})")
    assert not found, "\n".join(found[:60]) + (f"\n... and {len(found) - 60} more" if len(found) > 60 else "")
