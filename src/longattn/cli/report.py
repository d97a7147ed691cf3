"""`longattn report DIR`: one Markdown page gathering every lab result under a sweep directory."""

from __future__ import annotations


def add_parser(sub) -> None:
    import argparse
    p = sub.add_parser("report", help="gather a directory of lab results into one Markdown page",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Collect the Markdown table and plot that each lab command wrote under DIR "
                                   "(quality, retrieval, ...) into one page.")
    p.add_argument("dir", metavar="DIR", help="directory holding lab results (searched recursively)")
    p.add_argument("--output", default=None, help="the page to write (default: DIR/report.md)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..lab.report import gather_report
    print(f"wrote {gather_report(args.dir, args.output)}")
    return 0
