"""Run the whole matrix of faults in jobs of several servers, for ``docs/reliability.md``.

Every field Blink checks (shape, dtype, op, root, prescale, postscale,
collective, name) and a stalled rank, with the odd rank on either server or
the servers disagreeing, over 1x4, 2x2 and 4x1 layouts, under Gloo and MPI:
``tests/integration/test_reliability_servers.py`` with
``BLINK_FAULT_MATRIX=full`` (CI runs a few of its cases).  Each case is one
``horovodrun`` job of four ranks (about 15 s on two cores; the whole matrix
about 20 minutes)::

    .venv/bin/python benchmarks/cross_server_faults.py -o build/cross_server.json
    .venv/bin/python benchmarks/reliability_report.py build/reliability.json build/cross_server.json \\
        -o docs/reliability.md

``-k EXPR`` picks cases as pytest's ``-k`` does (e.g. ``-k "gloo and 2x2"``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="build/cross_server.json", help="the run's rows (JSON)")
    parser.add_argument("-k", dest="select", default="", help="only the cases pytest -k selects")
    args = parser.parse_args(argv)
    env = dict(os.environ, BLINK_FAULT_MATRIX="full", RELIABILITY_JSON=str(Path(args.output).resolve()),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [sys.executable, "-m", "pytest", "tests/integration/test_reliability_servers.py", "-q", "-rA",
           "--timeout=300"]
    if args.select:
        cmd += ["-k", args.select]
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    print(f"cross_server_faults: rows in {args.output} (pytest exit {rc})", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
