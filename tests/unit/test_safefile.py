"""distdiag/report/safefile.py: outputs never written through a link, inputs read only as
regular files of bounded size, strings printed without terminal escapes (issue 24)."""

from __future__ import annotations

import os
import threading

import pytest

from distdiag.report.safefile import (
    RefusedFile,
    check_output_path,
    open_append,
    printable,
    read_bytes_limited,
    write_atomic,
)


def test_write_atomic_writes_a_regular_file_and_replaces_it(tmp_path):
    """The healthy twin: a new path, then the same path again, in a folder made on the way."""
    path = tmp_path / "sub" / "out.json"
    write_atomic(path, "one")
    write_atomic(path, b"two")
    assert path.read_text() == "two" and os.listdir(path.parent) == ["out.json"]


def test_write_atomic_refuses_a_parent_that_is_a_file(tmp_path):
    (tmp_path / "dd").write_text("a file")
    with pytest.raises(RefusedFile, match=r"hang-report.json: .*/dd is not a directory"):
        write_atomic(tmp_path / "dd" / "hang-report.json", "{}")
    assert (tmp_path / "dd").read_text() == "a file"


def test_check_output_path_names_what_stands_there(tmp_path):
    (tmp_path / "f").write_text("x")
    check_output_path(tmp_path / "f")  # a regular file: fine
    check_output_path(tmp_path / "new")  # nothing: fine
    os.symlink(tmp_path / "f", tmp_path / "l")
    with pytest.raises(RefusedFile, match=r"l is a symbolic link \(to .*/f\); refusing to write through it \(fix\)"):
        check_output_path(tmp_path / "l", "fix")
    with pytest.raises(RefusedFile, match="is a character device, not a regular file"):
        check_output_path("/dev/null")
    with pytest.raises(RefusedFile, match=r"/f is not a directory; pick a file path"):
        check_output_path(tmp_path / "f" / "x")


@pytest.mark.parametrize("kind", ["link", "dangling", "fifo"])
def test_open_append_refuses_links_and_fifos(tmp_path, kind):
    """The monitor's log: a link is not appended through, a FIFO without a reader does not block."""
    victim, path = tmp_path / "victim", tmp_path / "log.jsonl"
    if kind == "link":
        victim.write_text("precious")
        path.symlink_to(victim)
    elif kind == "dangling":
        path.symlink_to(victim)
    else:
        os.mkfifo(path)
    with pytest.raises(RefusedFile):
        open_append(path)
    assert (victim.read_text() == "precious") if kind == "link" else not victim.exists()


def test_open_append_appends(tmp_path):
    path = tmp_path / "logs" / "m.jsonl"
    for line in ("a\n", "b\n"):
        with open_append(path) as handle:
            handle.write(line)
    assert path.read_text() == "a\nb\n"


def test_read_bytes_limited_refuses_a_fifo_without_blocking(tmp_path):
    """Opened non-blocking, a FIFO with no writer is refused at once (a thread bounds the test)."""
    os.mkfifo(tmp_path / "p")
    raised: list[BaseException] = []

    def read() -> None:
        try:
            read_bytes_limited(tmp_path / "p", 100, "a config")
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            raised.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "read_bytes_limited blocked on a FIFO"
    assert isinstance(raised[0], RefusedFile) and "is a FIFO (named pipe), not a config" in str(raised[0])


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda p: p.symlink_to("/dev/zero"), "is a character device, not a config"),
        (lambda p: p.mkdir(), "is a directory, not a config"),
        (lambda p: p.symlink_to(p), "is a symbolic link loop, not a config"),
        (lambda p: p.write_bytes(b"x" * 101), "is 101 bytes, over the 100 bytes limit for a config"),
    ],
    ids=["dev-zero", "directory", "loop", "oversize"],
)
def test_read_bytes_limited_refuses(tmp_path, setup, words):
    path = tmp_path / "c"
    setup(path)
    with pytest.raises(RefusedFile, match=words.replace("(", r"\(").replace(")", r"\)")):
        read_bytes_limited(path, 100, "a config")


def test_read_bytes_limited_follows_links_to_regular_files(tmp_path):
    """The healthy twin: an input that is a link to a file is read; exactly the limit is fine."""
    (tmp_path / "real").write_bytes(b"x" * 100)
    (tmp_path / "c").symlink_to(tmp_path / "real")
    assert read_bytes_limited(tmp_path / "c", 100, "a config") == b"x" * 100
    with pytest.raises(FileNotFoundError):
        read_bytes_limited(tmp_path / "missing", 100, "a config")


def test_printable_escapes_what_a_terminal_acts_on():
    text = "ok\tcol\nnext \x1b[31mred\x07\r\x9b\u202e é ✓"
    assert printable(text) == "ok\tcol\nnext \\x1b[31mred\\x07\\r\\x9b\\u202e é ✓"
    assert printable("a\nb\tc", one_line=True) == "a\\nb\\tc"


@pytest.mark.parametrize("kind", ["link", "regular"])
def test_monitor_log_is_never_appended_through_a_link(tmp_path, kind):
    """TrainingMonitor(log=a symlink): refused in one line, the linked file unchanged and no
    hook left on the optimizer; the healthy twin (a plain path) gets its header line."""
    import torch

    from distdiag.monitor import TrainingMonitor

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    victim, log = tmp_path / "victim", tmp_path / "m.jsonl"
    if kind == "link":
        victim.write_text("precious\n")
        log.symlink_to(victim)
        with pytest.raises(RefusedFile, match="is a symbolic link"):
            TrainingMonitor(model, every=1, log=log, optimizer=optimizer)
        assert victim.read_text() == "precious\n"
        assert not optimizer._optimizer_step_pre_hooks  # nothing half-built is called at step()
    else:
        mon = TrainingMonitor(model, every=1, log=log, optimizer=optimizer)
        mon.close()
        assert '"kind": "header"' in log.read_text().splitlines()[0]
