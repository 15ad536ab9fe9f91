"""Run Horovod's own ``test/parallel/test_torch.py`` under ``horovodrun``, stock or with ``BLINK_ENABLE=1``.

The reference suite is Horovod's (Apache-2.0, not part of this repository):
put a copy of ``test/parallel/test_torch.py`` and its ``test/utils/common.py``
in a git-ignored folder (``.carry/hvd-tests/{parallel,utils}``, which the
GPU acceptance carries to the device) and point ``--suite`` at the test file.

The suite calls ``hvd.shutdown()`` / ``hvd.init()`` around every test; on a
loaded machine stock Horovod 0.28.1 sometimes aborts inside ``hvd.init``
(a C++ abort, exit 134) and takes the rest of the session with it.  So this
driver runs the suite in one ``horovodrun`` job, reads each rank's per-test
verdicts from horovodrun's ``--output-filename`` files, and when a job dies
it records the test that was running as ``CRASH`` and starts a new job with
the remaining tests.  ``--per-test`` runs every test in a job of its own
instead: slower, but a test that fails on one rank (the others then wait in
a collective it never submits) cannot hang the tests after it.  A test passes
only if it passed on every rank; it fails if it failed on any.

    python tests/parallel/ops_reference_suite.py --suite .carry/hvd-tests/parallel/test_torch.py -np 2 \\
        -H localhost:2 [--blink] [--json out.json]

Every rank loads ``ops_workers/reference_suite_plugin.py``: where local ranks
share GPUs, the suite's ``cuda:<local rank>`` is placed on the GPUs there are
(it assumes one GPU per local rank), and each failure's reason is printed as
it happens.

Prints the counts (passed, failed, skipped, crashed) and, with ``--json``,
writes every test's verdict.  ``--shard I/N`` runs one of N interleaved shares
(several can run at once), ``--deadline`` stops in time and reports the rest
``NOTRUN``, and ``--done`` continues from an earlier run's ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

VERDICT = re.compile(r"(\S+\.py::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
RANK_ORDER = {"ERROR": 4, "FAILED": 4, "CRASH": 5, "SKIPPED": 1, "XFAIL": 1, "PASSED": 0, "XPASS": 0}


def _isolated(suite: Path) -> list[str]:
    """pytest options that keep this project's pytest.ini out of the reference suite's run."""
    return ["-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(suite.parent)]


def collect(python: str, suite: Path, env: dict) -> list[str]:
    p = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", *_isolated(suite), suite.name],
                       check=False, capture_output=True, text=True, timeout=600, env=env, cwd=suite.parent)
    ids = [ln.strip() for ln in p.stdout.splitlines() if "::" in ln]
    if not ids:
        raise SystemExit(f"collected no tests from {suite}:\n{p.stdout}\n{p.stderr}")
    return ids


def short_name(tid: str) -> str:
    """A test id's last part: ``test_torch.py::TorchTests::test_a`` -> ``test_a`` (what ``--only`` takes)."""
    return tid.rsplit("::", 1)[-1]


# Loaded into every rank (its folder on PYTHONPATH): CUDA ordinals placed on the GPUs that local ranks
# share, and each failure's reason printed as it happens.
PLUGIN = Path(__file__).resolve().parent / "ops_workers" / "reference_suite_plugin.py"

# what pytest-timeout prints before it ends a rank whose test ran past --test-timeout
TIMEOUT_MARK = re.compile(r"\+{5,} Timeout \+{5,}")


def run_job(args, ids: list[str], env: dict, outdir: Path,
            limit: float | None = None) -> tuple[dict[str, str], bool, bool]:
    """One horovodrun job over ``ids`` (killed after ``limit`` seconds where given); returns (verdicts,
    crashed, timed_out): the verdicts of the tests that ended, whatever ended the job, and whether a
    rank's test ran past --test-timeout (a hang, not an abort: running it again would hang again)."""
    shutil.rmtree(outdir, ignore_errors=True)
    cmd = [args.horovodrun, "-np", str(args.np), "-H", args.hosts, args.controller,
           "--output-filename", str(outdir),
           args.python, "-m", "pytest", "-v", *_isolated(Path(args.suite).resolve()), "-p", PLUGIN.stem,
           f"--timeout={args.test_timeout}",
           f"--timeout-method={args.timeout_method}", *ids]
    timeout = args.job_timeout if len(ids) > 1 or not args.per_test else args.test_timeout + 120
    if limit is not None:
        timeout = max(1.0, min(timeout, limit))
    # a session of its own, so that a timeout kills the ranks too, not only horovodrun
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=Path(args.suite).parent, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = 124
    if os.environ.get("OPS_REF_DEBUG"):
        print(f"[ref] rc={rc} cmd={' '.join(cmd[:12])} ...", file=sys.stderr)
        if rc not in (0, 1):
            print("\n".join((out or "").splitlines()[-15:]), file=sys.stderr)
    per_rank: list[dict[str, str]] = []
    timed_out = False
    for rank_dir in sorted(outdir.glob("rank.*")):
        text = ""
        for name in ("stdout", "stderr"):
            f = rank_dir / name
            if f.exists():
                text += f.read_text(errors="replace")
        timed_out = timed_out or bool(TIMEOUT_MARK.search(text))
        # horovodrun prefixes every line with "[rank]<stdout>:"
        per_rank.append({re.sub(r"^.*>:", "", m.group(1)).split("/")[-1]: m.group(2) for m in VERDICT.finditer(text)})
    verdicts: dict[str, str] = {}
    for tid in ids:
        key = tid.split("/")[-1]
        vs = [r.get(key) for r in per_rank]
        if vs and any(v in ("FAILED", "ERROR") for v in vs):
            verdicts[tid] = "FAILED"  # a rank failed; the others may have hung waiting for it
            continue
        if any(v is None for v in vs) or not vs:
            continue
        verdicts[tid] = max(vs, key=lambda v: RANK_ORDER.get(v, 4))
    crashed = rc != 0 and len(verdicts) < len(ids) and not (rc == 1 and len(verdicts) == len(ids))
    return verdicts, crashed, timed_out


def _keep(args, outdir: Path) -> None:
    """With ``--keep-logs``, keep a job's per-rank stdout/stderr (they explain a FAILED or CRASH verdict)."""
    if args.keep_logs and outdir.exists():
        dest = Path(args.keep_logs) / outdir.name
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(outdir, dest)


def count_verdicts(verdicts: Iterable[str]) -> dict[str, int]:
    """How many of each verdict, pytest's ERROR, XFAIL and XPASS counted as FAILED, SKIPPED and PASSED."""
    counts: dict[str, int] = {}
    for v in verdicts:
        v = {"ERROR": "FAILED", "XFAIL": "SKIPPED", "XPASS": "PASSED"}.get(v, v)
        counts[v] = counts.get(v, 0) + 1
    return counts


def _earlier_verdicts(paths: list[str], mode: str, ids: list[str]) -> dict[str, str]:
    """The verdicts (other than NOTRUN) that earlier runs of the same mode wrote for tests among ``ids``."""
    found: dict[str, str] = {}
    for path in paths:
        earlier = json.loads(Path(path).read_text())
        if earlier.get("mode") != mode:
            raise SystemExit(f"--done {path}: a run with mode {earlier.get('mode')!r}, this one is {mode!r}")
        found.update({t: v for t, v in earlier.get("tests", {}).items() if t in ids and v != "NOTRUN"})
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", required=True, help="path of Horovod's test_torch.py (a local copy)")
    ap.add_argument("-np", type=int, default=2)
    ap.add_argument("-H", "--hosts", default="localhost:2")
    ap.add_argument("--controller", default="--gloo", choices=["--gloo", "--mpi"])
    ap.add_argument("--blink", action="store_true", help="run with BLINK_ENABLE=1")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--horovodrun", default=os.path.join(os.path.dirname(sys.executable), "horovodrun"))
    ap.add_argument("--test-timeout", type=int, default=300)
    ap.add_argument("--job-timeout", type=int, default=3600)
    # pytest-timeout's SIGALRM cannot interrupt a rank blocked in stock Horovod's C++ wait
    # (hvd.synchronize holds no Python frame to raise in), so a test left waiting for a
    # collective that its peers never submit hangs the whole job until --job-timeout.
    # "thread" ends the rank instead; the job then dies and the test is retried / counted as CRASH.
    ap.add_argument("--timeout-method", default="signal", choices=["signal", "thread"],
                    help="pytest-timeout's method inside the ranks (thread: a hung rank exits)")
    ap.add_argument("-k", default="", help="only tests whose id contains this")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="only the test named NAME, exactly (repeatable; test_x does not select test_x_y)")
    ap.add_argument("--shard", default="", metavar="I/N",
                    help="only the I-th of N interleaved shares of the tests (0 <= I < N), so that a suite too long "
                         "for one sitting runs in N")
    ap.add_argument("--per-test", action="store_true",
                    help="one horovodrun job per test (a failing test cannot leave the next one hanging; "
                         "each job is limited to --test-timeout + 120 s)")
    ap.add_argument("--deadline", type=float, default=0.0, metavar="S",
                    help="stop after S seconds: the running job is ended, the tests it finished keep their "
                         "verdicts and the rest are reported NOTRUN (0: no deadline)")
    ap.add_argument("--done", action="append", default=[], metavar="JSON",
                    help="an earlier run's --json (repeatable): its tests with a verdict other than NOTRUN keep "
                         "that verdict and are not run again; only the rest run (a suite continued over sittings)")
    ap.add_argument("--json", default="")
    ap.add_argument("--keep-logs", default="",
                    help="copy every job's per-rank output (horovodrun's --output-filename folders) here")
    args = ap.parse_args(argv)

    env = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    env["PATH"] = os.path.dirname(args.python) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN.parent), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if args.blink:
        env["BLINK_ENABLE"] = "1"
        for k in ("BLINK_PLAN_CACHE", "BLINK_TIMEOUT_SECONDS", "BLINK_LOCAL_SIZE", "BLINK_LOG_LEVEL"):
            if k in os.environ:
                env[k] = os.environ[k]
    suite = Path(args.suite).resolve()
    shard = (0, 1)
    if args.shard:
        try:
            shard = tuple(int(v) for v in args.shard.split("/"))  # type: ignore[assignment]
            if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
                raise ValueError
        except ValueError:
            ap.error(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
    ids = [t for t in collect(args.python, suite, env) if args.k in t]
    if args.only:
        unknown = sorted(set(args.only) - {short_name(t) for t in ids})
        if unknown:
            ap.error(f"--only: no test named {', '.join(unknown)} in {suite}" + (f" (-k {args.k!r})" if args.k else ""))
        ids = [t for t in ids if short_name(t) in args.only]
    ids = ids[shard[0]::shard[1]]
    results: dict[str, str] = _earlier_verdicts(args.done, "BLINK_ENABLE=1" if args.blink else "stock", ids)
    remaining = [t for t in ids if t not in results]
    if args.done:
        print(f"[ref] {len(results)} of {len(ids)} verdicts taken from --done; {len(remaining)} tests to run",
              file=sys.stderr, flush=True)
    retried: set[str] = set()
    jobs = 0
    t0 = time.time()

    def left_s() -> float | None:  # what the deadline leaves (None: no deadline)
        return None if args.deadline <= 0 else args.deadline - (time.time() - t0)

    def out_of_time() -> bool:
        left = left_s()
        return left is not None and left <= 1.0

    with tempfile.TemporaryDirectory(prefix="hvdref-") as tmp:
        while remaining and args.per_test and not out_of_time():
            tid = remaining.pop(0)
            jobs += 1
            verdicts, _, _ = run_job(args, [tid], env, Path(tmp) / f"job{jobs}", left_s())
            if tid not in verdicts and out_of_time():
                remaining.insert(0, tid)
                break
            _keep(args, Path(tmp) / f"job{jobs}")
            results[tid] = verdicts.get(tid, "CRASH")
            print(f"[ref] {results[tid]:8s} {tid}", file=sys.stderr, flush=True)
        while remaining and not out_of_time():
            jobs += 1
            started = time.time()
            verdicts, crashed, timed_out = run_job(args, remaining, env, Path(tmp) / f"job{jobs}", left_s())
            _keep(args, Path(tmp) / f"job{jobs}")
            results.update(verdicts)
            done = [t for t in remaining if t in verdicts]
            left = [t for t in remaining if t not in verdicts]
            print(f"[ref] job {jobs}: {len(done)} tests in {time.time() - started:.0f} s", file=sys.stderr, flush=True)
            if not left:
                break
            if out_of_time():  # the deadline ended the job: what had not ended is not run, not crashed
                remaining = left
                break
            if not crashed and not done:
                for t in left:
                    results[t] = "CRASH"
                break
            # The first test without a verdict was running when the job died.  Stock Horovod's
            # aborts come from the hvd.init() after the previous test's hvd.shutdown(), so the
            # test gets one more chance as the first test of a fresh job before it counts as CRASH
            # (not one that ran past its timeout: that is a hang, and would hang again).
            victim = left[0]
            if victim == remaining[0] or victim in retried or timed_out:
                results[victim] = "CRASH"
                remaining = left[1:]
            else:
                retried.add(victim)
                remaining = left
            print(f"[ref] job {jobs}: {victim} {'timed out' if timed_out else 'crashed the job'} "
                  f"({'counted' if victim in results else 'retrying'}); "
                  f"{len(remaining)} tests left", file=sys.stderr, flush=True)
        for t in remaining:
            results.setdefault(t, "NOTRUN")
    counts = count_verdicts(results.get(t, "CRASH") for t in ids)
    mode = "BLINK_ENABLE=1" if args.blink else "stock"
    print(f"[ref] {mode} -np {args.np} -H {args.hosts} {args.controller}: "
          f"{counts.get('PASSED', 0)} passed, {counts.get('FAILED', 0)} failed, {counts.get('SKIPPED', 0)} skipped, "
          f"{counts.get('CRASH', 0)} crashed, {counts.get('NOTRUN', 0)} not run (deadline) ({jobs} job(s), {len(retried)} test(s) retried after a job died, "
          f"{time.time() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": mode, "np": args.np, "hosts": args.hosts,
                                               "controller": args.controller, "shard": args.shard or "0/1",
                                               "counts": counts,
                                               "jobs": jobs, "retried": sorted(retried),
                                               "tests": {t: results.get(t, "CRASH") for t in ids}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
