"""`python -m bench`: list the benchmarks; `python -m bench NAME [options]` runs one; `python -m bench report`
runs the report's set and writes docs/benchmarks.md (what `mergebroker bench` does)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.registry import BENCHMARKS, BY_NAME


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark `argv[0]` names with the rest of `argv`, or list them; the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "report":
        from bench.report import main as report

        return report(args[1:])
    if not args or args[0] in ("-h", "--help", "list"):
        width = max(len(b.name) for b in BENCHMARKS)
        print("python -m bench NAME [options]   (python -m bench NAME --help for its options)\n")
        for b in BENCHMARKS:
            note = " [in the report]" if b.report else " [a process the others start]" if b.process else ""
            print(f"  {b.name.ljust(width)}  {b.measures}{note}")
        print(f"  {'report'.ljust(width)}  run the report's benchmarks and write docs/benchmarks.md")
        return 0
    benchmark = BY_NAME.get(args[0])
    if benchmark is None:
        print(f"python -m bench: no benchmark {args[0]!r}; `python -m bench` lists them", file=sys.stderr)
        return 2
    return benchmark.entry()(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
