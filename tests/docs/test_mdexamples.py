"""The doc-test markers: a fence that is unlabelled, skipped without a reason or installs
packages unmarked is reported; a skip's reason keeps its semicolons."""

from __future__ import annotations

from pathlib import Path

from tests.docs.mdexamples import problems
from tests.docs.test_doc_examples import examples_of


def _one(tmp_path: Path, text: str):
    doc = tmp_path / "page.md"
    doc.write_text(text)
    (ex,) = examples_of(doc)
    return ex


def test_unlabelled_fence_is_reported(tmp_path):
    assert "label it" in problems(_one(tmp_path, "```\ndistdiag probes\n```\n"))[0]


def test_skip_needs_a_reason_and_keeps_its_semicolons(tmp_path):
    assert "needs a reason" in problems(_one(tmp_path, "<!-- doc-test: skip: -->\n```bash\nx\n```\n"))[0]
    ex = _one(tmp_path, "<!-- doc-test: exit: 3; skip: a GPU; and a cluster -->\n\n```bash\nx\n```\n")
    assert ex.get("skip") == "a GPU; and a cluster" and ex.get("exit") == "3" and not problems(ex)


def test_pip_install_needs_a_marker(tmp_path):
    assert "pip install" in problems(_one(tmp_path, "```bash\npip install -e . && distdiag probes\n```\n"))[0]
    assert not problems(_one(tmp_path, "<!-- doc-test: installed -->\n```bash\npip install -e . && distdiag probes\n```\n"))


def test_replace_must_match_the_example(tmp_path):
    ex = _one(tmp_path, "<!-- doc-test: replace: --nproc 8 => --nproc 2 -->\n```bash\ndistdiag probes\n```\n")
    assert "is not in the example" in problems(ex)[0]
