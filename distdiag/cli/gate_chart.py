"""`python -m distdiag.cli.gate_chart REPORT CHART -- COMMAND...`: draw the gate's chart, then
become COMMAND.

What `distdiag gate --chart` runs in place of the training command when the gate passes: the
gate execs its command, so the chart is drawn here, from the report the gate just read, and
then this process execs the real command (its exit code is the command's, as without
--chart). A chart that cannot be drawn is one line on stderr; the job starts all the same.
"""

from __future__ import annotations

import sys

__all__ = ["draw_from", "main"]


def draw_from(report_path: str, chart: str, who: str = "distdiag gate") -> bool:
    """Draw the bandwidth chart of the report at `report_path` to `chart`; one line on stderr
    (starting `who`) saying where, or why not. True when written."""
    from distdiag.errors import DistDiagError, ReportError
    from distdiag.report.bandwidth_chart import draw_bandwidth_chart
    from distdiag.report.model import read_report

    try:
        written = draw_bandwidth_chart(read_report(report_path), chart)
    except (ReportError, ValueError) as exc:
        sys.stderr.write(f"{who}: note: {exc}; {chart} not written\n")
        return False
    except (OSError, DistDiagError) as exc:
        sys.stderr.write(f"{who}: cannot write the chart to {chart}: {getattr(exc, 'strerror', None) or exc}\n")
        return False
    sys.stderr.write(f"{who}: bandwidth chart written to {written}\n")
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: python -m distdiag.cli.gate_chart REPORT CHART -- COMMAND...\n")
        return 2
    report, chart, command = argv[0], argv[1], argv[3:]
    draw_from(report, chart)
    from distdiag.launcher.child import exec_command

    return exec_command(command)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
