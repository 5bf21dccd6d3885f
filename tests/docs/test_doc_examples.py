"""Every fenced example of README.md and docs/ runs as shown (tests/docs/mdexamples.py says how a
fence's `doc-test` marker changes that: skipped with a reason, a smaller world, a toy prelude),
and the docs speak to users: no internal issue numbers."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest

from tests.docs.mdexamples import ROOT, Example, all_examples, doc_files, examples, problems
from tests.harness import run_within

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

DEFAULT_LIMIT_S = 120
LINKED = ("configs", "launch", "tests", "benchmarks", "docs", "distdiag")
"""Repository folders the examples' commands name, linked into each doc's working directory."""


def test_every_fence_is_labelled_and_marked():
    """Each fence names its language and carries a well-formed marker: nothing is skipped silently."""
    wrong = [f"{ex.where}: {p}" for ex in all_examples() for p in problems(ex)]
    assert not wrong, "\n".join(wrong)


def test_the_runner_fails_an_unmarked_example_that_fails(tmp_path):
    """A failing command with no marker fails the run (the test would catch a broken example)."""
    doc = tmp_path / "broken.md"
    doc.write_text("```bash\ndistdiag no-such-command\n```\n")
    (ex,) = examples_of(doc)
    with pytest.raises(AssertionError, match="no-such-command"):
        run_example(ex, tmp_path)


def test_no_internal_issue_numbers():
    """README and docs describe what a feature does, not which tracker issue asked for it."""
    pattern = re.compile(r"\b[Ii]ssues? #?\d+|\(#\d+\)")
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for path in doc_files()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "internal issue numbers in the docs:\n" + "\n".join(hits)


@pytest.mark.parametrize("ex", [ex for ex in all_examples() if ex.lang == "toml"], ids=lambda ex: ex.where)
def test_toml_examples_are_valid_configs(ex: Example):
    """A config shown in the docs is accepted whole by `--config` (every key and probe table)."""
    from distdiag.check.config import merge_config
    from distdiag.check.plan import validate_names_and_options

    merge_config([(ex.where, tomllib.loads(ex.body))], {}, validate=validate_names_and_options)


@pytest.mark.parametrize("ex", [ex for ex in all_examples() if ex.lang == "json"], ids=lambda ex: ex.where)
def test_json_examples_parse(ex: Example):
    json.loads(ex.body)


def _limit(doc: Path) -> int:
    return sum(int(ex.get("timeout", str(DEFAULT_LIMIT_S))) for ex in examples(doc) if ex.runs)


RUN_DOCS = [doc for doc in doc_files() if any(ex.runs for ex in examples(doc))]


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "doc",
    [pytest.param(doc, marks=pytest.mark.timeout(_limit(doc) + 60), id=doc.relative_to(ROOT).as_posix()) for doc in RUN_DOCS],
)
def test_doc_examples_run(doc: Path, tmp_path: Path):
    """The doc's examples, in order, in one working directory (a file one writes, the next uses)."""
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    for ex in examples(doc):
        run_example(ex, tmp_path)


# -- running one example ---------------------------------------------------------------------


def examples_of(path: Path) -> list[Example]:
    """Examples of a markdown file outside the repository (the runner's own test)."""
    import tests.docs.mdexamples as md

    saved = md.ROOT
    md.ROOT = path.parent
    try:
        return md.examples(path)
    finally:
        md.ROOT = saved


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("DISTDIAG_INJECT", None)
    # torchrun reads every option from PET_<NAME> too: a port of its own per example, so that
    # examples running side by side (pytest-xdist) do not meet on torchrun's default 29500.
    env["PET_MASTER_PORT"] = str(_free_port())
    return env


def _shell(ex: Example, body: str) -> str:
    if ex.has("installed"):  # the test runs in an installed checkout: leave pip out
        kept = []
        for line in body.splitlines():
            parts = [p for p in line.split("&&") if not p.strip().startswith("pip install")]
            if parts:
                kept.append("&&".join(parts).strip())
        body = "\n".join(kept) + "\n"
    return "set -eo pipefail\n" + body


def run_example(ex: Example, cwd: Path) -> None:
    """Run (or, for `file:`, write) one example in `cwd`; fail with its output when its exit code
    is not the expected one or it runs past its limit."""
    if ex.lang not in ("bash", "python") or ex.has("skip"):
        return
    if any(importlib.util.find_spec(name) is None for name in ex.all("needs")):
        return  # an optional extra this environment lacks (the marker names it)
    body = ex.body
    for rule in ex.all("replace"):
        old, new = (s.strip() for s in rule.split("=>", 1))
        body = body.replace(old, new)
    if ex.has("file"):
        target = cwd / ex.get("file")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
        return
    for spec in ex.all("copy"):
        src, _, dest = spec.partition(" as ")
        shutil.copy(ROOT / src.strip(), cwd / (dest.strip() or Path(src.strip()).name))
    stem = f"example-{ex.line}"
    for setup in ex.all("setup"):
        rc, _ = run_within([sys.executable, str(ROOT / setup)], str(cwd), DEFAULT_LIMIT_S, env=_env())
        assert rc == 0, f"{ex.where}: setup {setup} exit {rc}\n{(cwd / 'output.txt').read_text(errors='replace')[-3000:]}"
    if ex.lang == "bash":
        script = cwd / f"{stem}.sh"
        script.write_text(_shell(ex, body))
        cmd = ["bash", str(script)]
    else:
        prelude = ex.get("prelude")
        text = ((ROOT / prelude).read_text() + "\n# --- the example ---\n" if prelude else "") + body
        script = cwd / f"{stem}.py"
        script.write_text(text)
        ranks = ex.get("ranks")
        cmd = [sys.executable, str(script)]
        if ranks:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks, str(script)]
    limit = int(ex.get("timeout", str(DEFAULT_LIMIT_S)))
    rc, took = run_within(cmd, str(cwd), limit, env=_env())
    output = (cwd / "output.txt").read_text(errors="replace")
    (cwd / "output.txt").rename(cwd / f"{stem}.out")
    expected = int(ex.get("exit", "0"))
    assert rc == expected, (
        f"{ex.where}: exit {rc}, expected {expected} ({took:.0f}s, limit {limit}s)\n--- example ---\n{body}"
        f"--- output (tail) ---\n{output[-4000:]}"
    )


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower().replace("_", "\0")).replace("\0", "_")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_relative_links_resolve():
    """A link from README or docs/ to a repository file (and #section) lands on it."""
    broken = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", dest.read_text(encoding="utf-8"), re.M)}
                if anchor not in heads:
                    broken.append(f"{path.relative_to(ROOT)}: {target} (no such section)")
    assert not broken, "\n".join(broken)
