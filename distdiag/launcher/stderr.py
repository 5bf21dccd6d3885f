"""torchrun's stderr as the user should see it: its log lines, the OMP_NUM_THREADS banner and
its closing ChildFailedError traceback left out (all of it with DISTDIAG_DEBUG=1), the ranks'
own lines kept. `distdiag check` and `distdiag gate` write it once the job ended
(`filter_torchrun_stderr`); `distdiag watch` passes it on as it comes (`WatchOutput`), since a
training job's output is worth seeing while it runs."""

from __future__ import annotations

import re
import sys
from typing import IO

__all__ = ["GLOG", "filter_torchrun_stderr", "collect", "WatchOutput", "pump"]

GLOG = re.compile(r"^([WEIF]\d{4} \d\d:\d\d:\d\d|\*+\s*$|Setting OMP_NUM_THREADS environment variable)")
"""torchrun's own log lines (glog's prefix), its banner's rules and the OMP_NUM_THREADS banner."""

_TORCHRUN_FRAME = re.compile(r'^\s*File ".*(torch/distributed/(run|launch|elastic/|launcher/)|/torchrun")')
"""A frame of torchrun's own: its modules, or its console script (`/usr/bin/torchrun`)."""
_ENDING = re.compile(r"^distdiag\[rank \d+\]: watchdog ending the process")
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def filter_torchrun_stderr(lines: list[str]) -> list[str]:
    """What `WatchOutput` lets through, for a job that has ended: one filter for both, so
    `distdiag check` and `distdiag watch` leave out the same lines."""
    kept: list[str] = []
    output = WatchOutput(_Lines(kept))
    for line in lines:
        output.line(line)
    output.close()
    return kept


class _Lines:
    """A text sink that keeps each write (one line each, as `WatchOutput` writes them)."""

    def __init__(self, into: list[str]) -> None:
        self.into = into

    def write(self, text: str) -> int:
        self.into.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def collect(src: IO[str], sink: list[str], live: bool) -> None:
    """Collect torchrun's stderr; live (DISTDIAG_DEBUG=1): also show every line as it comes,
    torchrun's log lines included, since that is what the errors tell users to rerun for.
    Rank 0's progress lines in plain logs (report/render.py PlainBeat) are shown as they come
    and not kept: they are signs of life, worth nothing once the job ended."""
    from distdiag.report.render import is_beat_line

    for line in src:
        beat = is_beat_line(line)
        if live or beat:
            sys.stderr.write(line)
            sys.stderr.flush()
        if not beat:
            sink.append(line)


class WatchOutput:
    """The ranks' stderr, line by line, as the user should see it: torchrun's log lines, the
    ranks' 'watchdog ending the process' lines and torchrun's own closing traceback are held
    back (`dropped`); a worker's traceback goes through once its first frame shows it is not
    torchrun's. `debug` passes everything."""

    def __init__(self, out: IO[str] | _Lines, debug: bool = False) -> None:
        self.out = out
        self.debug = debug
        self.held: list[str] = []
        self.holding = ""
        """'' passing lines, 'undecided' inside a traceback not yet placed, 'torchrun' in its."""
        self.dropped: list[str] = []
        self.verdict: list[str] = []
        """The report's closing lines ('verdict: ...', 'hang report: PATH') as a rank wrote them."""
        self.after_verdict = 0
        """The ranks' lines shown after them (a dying rank's traceback): the verdict is then said
        again at the end (`verdict_again`), so that it stays the last thing printed."""

    def line(self, line: str) -> None:
        if self.debug:
            self._write(line)
        elif self.holding == "torchrun":
            self.dropped.append(line)
        elif self.holding == "undecided":
            self.held.append(line)
            if line.lstrip().startswith("File ") and "<frozen runpy>" not in line:
                if _TORCHRUN_FRAME.match(line):
                    self.holding, self.dropped = "torchrun", self.dropped + self.held
                else:
                    self._release()
        elif line.startswith("Traceback (most recent call last):"):
            self.holding, self.held = "undecided", [line]
        elif GLOG.match(line) or _ENDING.match(line):
            self.dropped.append(line)
        else:
            self._write(line)

    def close(self) -> None:
        if self.holding == "undecided":
            self._release()

    def worker_exit_code(self) -> int | None:
        """The root-cause worker's exit code, from torchrun's failure summary (its other
        failures, listed first, are mostly ranks torchrun itself ended with SIGTERM)."""
        root = next((i for i, line in enumerate(self.dropped) if "Root Cause" in line), 0)
        for line in self.dropped[root:]:
            m = _EXITCODE.search(line)
            if m:
                code = int(m.group(1))
                return 128 - code if code < 0 else code
        return None

    def _release(self) -> None:
        for held in self.held:
            self._write(held)
        self.held, self.holding = [], ""

    def _write(self, line: str) -> None:
        if line.startswith("verdict: "):
            self.verdict, self.after_verdict = [line], 0
        elif self.verdict and not self.after_verdict and line.startswith("hang report: "):
            self.verdict.append(line)
        elif self.verdict and line.strip() and not line.startswith("distdiag"):
            self.after_verdict += 1
        self.out.write(line)
        self.out.flush()

    def verdict_again(self) -> None:
        """The verdict's lines once more when the ranks printed after them."""
        if self.verdict and self.after_verdict:
            self.out.write(f"\ndistdiag watch: the verdict again (the ranks printed {self.after_verdict} line(s) after it):\n")
            for line in self.verdict:
                self.out.write(line)
            self.out.flush()
            self.after_verdict = 0


def pump(src: IO[str], output: WatchOutput) -> None:
    for line in src:
        output.line(line)
    output.close()
