"""The fenced examples of README.md and docs/**/*.md, with the `doc-test` marker each carries.

Every fence names its language: `bash`, `python`, `toml` and `json` are examples the tests run
or load; `text` is output or a table shown, never run. An HTML comment right before a fence
(blank lines allowed between) says how the test runs it, visibly in the markdown:

    <!-- doc-test: skip: needs a GPU -->                         not run, with the reason why
    <!-- doc-test: file: train.py -->                            written to train.py for the
                                                                 fences after it, not run alone
    <!-- doc-test: prelude: docs/examples/loop.py; ranks: 2 -->  run after that file, under
                                                                 torchrun with 2 ranks
    <!-- doc-test: copy: docs/examples/train.py -->              that file copied first (as
                                                                 train.py: `copy: SRC as DEST`)
    <!-- doc-test: replace: --nproc-per-node 8 => --nproc-per-node 2 -->
                                                                 run with this text replaced
    <!-- doc-test: setup: docs/examples/make_logs.py -->        that script run in the directory
                                                                 first (the files the example reads)
    <!-- doc-test: needs: matplotlib -->                        not run where that module is
                                                                 missing (an optional extra; the
                                                                 trainers' pages name theirs, as
                                                                 tests/integrations skip without)
    <!-- doc-test: installed -->                                 `pip install ...` commands left
                                                                 out (the test runs installed)
    <!-- doc-test: exit: 3; timeout: 90 -->                      expected exit code (default 0),
                                                                 hard limit in seconds (120)

Keys may repeat (`replace`, `copy`) and combine with `;`; `skip` takes the rest of the comment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_LANGS = {"bash", "python"}
LOAD_LANGS = {"toml", "json"}
LANGS = RUN_LANGS | LOAD_LANGS | {"text"}
KEYS = {"skip", "file", "prelude", "ranks", "copy", "setup", "needs", "replace", "installed", "exit", "timeout"}
_MARK = re.compile(r"^<!--\s*doc-test:(.*?)-->\s*$")
_FENCE = re.compile(r"^(\s*)```(.*)$")


@dataclass
class Example:
    doc: str
    """Path relative to the repository root."""
    line: int
    """1-based line of the opening fence."""
    lang: str
    body: str
    marks: list[tuple[str, str]] = field(default_factory=list)
    """(key, value) pairs of the doc-test comment, in order."""

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def get(self, key: str, default: str | None = None) -> str | None:
        values = [v for k, v in self.marks if k == key]
        return values[-1] if values else default

    def all(self, key: str) -> list[str]:
        return [v for k, v in self.marks if k == key]

    def has(self, key: str) -> bool:
        return any(k == key for k, _ in self.marks)

    @property
    def runs(self) -> bool:
        """Run by the end-to-end test: a bash or python fence, not skipped, not only a file."""
        return self.lang in RUN_LANGS and not self.has("skip") and not self.has("file")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _parse_marks(text: str) -> list[tuple[str, str]]:
    marks = []
    parts = text.split(";")
    for n, part in enumerate(parts):
        key, _, value = part.strip().partition(":")
        if key.strip() == "skip":  # the reason is the rest of the comment, semicolons and all
            marks.append(("skip", ";".join([value, *parts[n + 1:]]).strip()))
            break
        if key.strip():
            marks.append((key.strip(), value.strip()))
    return marks


def examples(path: Path) -> list[Example]:
    """The fences of one markdown file, each with the marker comment before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    doc = path.relative_to(ROOT).as_posix()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).strip()
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:j]) + "\n"
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = _MARK.match(lines[k].strip()) if k >= 0 else None
        found.append(Example(doc, i + 1, lang, body, _parse_marks(mark.group(1)) if mark else []))
        i = j + 1
    return found


def all_examples() -> list[Example]:
    return [ex for path in doc_files() for ex in examples(path)]


def problems(ex: Example) -> list[str]:
    """What is wrong with a fence's label or marker (empty when nothing is)."""
    out = []
    if ex.lang not in LANGS:
        out.append(f"fence labelled {ex.lang!r}: label it one of {sorted(LANGS)} ('text' for output shown)")
    for key, value in ex.marks:
        if key not in KEYS:
            out.append(f"unknown doc-test key {key!r}; known: {', '.join(sorted(KEYS))}")
        elif key == "skip" and not value:
            out.append("'skip' needs a reason: <!-- doc-test: skip: why it cannot run here -->")
        elif key == "replace" and "=>" not in value:
            out.append(f"'replace' needs OLD => NEW, got {value!r}")
        elif key == "replace" and value.split("=>")[0].strip() not in ex.body:
            out.append(f"'replace' text {value.split('=>')[0].strip()!r} is not in the example")
        elif key in ("prelude", "copy", "setup") and not (ROOT / value.split(" as ")[0].strip()).is_file():
            out.append(f"'{key}' names {value!r}, which is not a file of the repository")
        elif key in ("exit", "ranks", "timeout") and not value.isdigit():
            out.append(f"'{key}' needs a number, got {value!r}")
    if ex.marks and ex.lang == "text":
        out.append("a 'text' fence is output shown and is never run: it takes no doc-test marker")
    if ex.lang == "bash" and re.search(r"(^|&&|\n)\s*pip install", ex.body) and not (ex.has("skip") or ex.has("installed")):
        out.append("runs 'pip install': mark it 'installed' (the test leaves pip out) or 'skip: why'")
    return out
