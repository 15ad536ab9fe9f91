"""The plan cache under faults: killed writers, corrupt entries, concurrent writers.

Reliability requirement (Resources) and docs/formats.md, Environment variables (``BLINK_PLAN_CACHE``): "the
plan cache is written atomically (a writer killed midway leaves no torn file;
a corrupt cache entry is ignored and rebuilt)".

A writer is frozen *inside* its write (``json.dump`` replaced in the writer
process by one that writes half the entry, syncs it to disk and sleeps), so
the SIGKILL lands exactly midway, every run, not by luck of timing.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from blink_horovod.planner import cache
from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.topology.machines import resolve

pytestmark = pytest.mark.timeout(120)

TOPOLOGY = "cpu3"


def cpu3_allreduce_plan(rate: float = 20.0) -> Plan:
    """A valid allreduce plan of ``cpu3`` (GPU i roots the i-th third), built by hand."""
    third = 1.0 / 3.0
    return Plan(
        collective="allreduce",
        topology=TOPOLOGY,
        gpus=(0, 1, 2),
        root=None,
        trees=(
            Tree(0, third, ((0, 1), (1, 2))),
            Tree(1, third, ((1, 2), (1, 0))),
            Tree(2, 1.0 - 2 * third, ((2, 0), (0, 1))),
        ),
        rate_gbps=rate,
        optimum_gbps=rate,
    )


def entry_path(cache_dir: Path) -> Path:
    return cache_dir / f"{cache.cache_key(resolve(TOPOLOGY), 'allreduce')}.json"


WRITER = textwrap.dedent(
    """
    import json, os, sys, time
    from blink_horovod.planner import cache
    from blink_horovod.planner.plan import Plan
    from blink_horovod.topology.machines import resolve

    plan = Plan.from_json(sys.argv[2])

    def frozen_dump(obj, fh, **kw):
        # Write half the entry, make it durable, then hang: the test kills us here.
        text = json.dumps(obj, **kw)
        fh.write(text[: len(text) // 2])
        fh.flush()
        os.fsync(fh.fileno())
        print("HALF", flush=True)
        time.sleep(600)

    json.dump = frozen_dump
    cache.store_plan(plan, resolve({topology!r}), "allreduce", None, None, sys.argv[1])
    print("STORED", flush=True)
    """
)


def start_frozen_writer(cache_dir: Path, plan: Plan) -> subprocess.Popen:
    script = WRITER.format(topology=TOPOLOGY)
    return subprocess.Popen(
        [sys.executable, "-c", script, str(cache_dir), plan.to_json(indent=None)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_line(proc: subprocess.Popen, expected: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if line.strip() == expected:
                return
            if not line and proc.poll() is not None:
                break
    proc.kill()
    pytest.fail(f"writer never printed {expected!r}: rc {proc.poll()}, stderr {proc.stderr.read()[-2000:]}")


def valid_entries(cache_dir: Path) -> list[Path]:
    """Every ``*.json`` entry; fails on any that is not a whole, parseable entry."""
    out = []
    for path in sorted(cache_dir.glob("*.json")):
        data = json.loads(path.read_text())  # a torn file fails right here
        assert data["format"] == cache.ENTRY_FORMAT
        Plan.from_dict(data["plan"])
        out.append(path)
    return out


@pytest.mark.parametrize("existing", [False, True], ids=["new-entry", "overwrite"])
def test_writer_killed_midway_leaves_no_torn_entry(tmp_path: Path, existing: bool, record, caplog) -> None:
    cache_dir = tmp_path / "plans"
    topo = resolve(TOPOLOGY)
    old = cpu3_allreduce_plan(rate=11.0)
    if existing:
        assert cache.store_plan(old, topo, "allreduce", cache_dir=cache_dir) == entry_path(cache_dir)
    writer = start_frozen_writer(cache_dir, cpu3_allreduce_plan(rate=22.0))
    wait_line(writer, "HALF")
    # Half an entry is on disk now, under a temporary name.
    temps = list(cache_dir.glob(".*.tmp"))
    assert temps and all(p.stat().st_size > 0 for p in temps)
    t0 = time.monotonic()
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=10)
    writer.stdout.close()
    writer.stderr.close()

    # The entry itself is absent (new) or still the old, whole one (overwrite).
    with caplog.at_level(logging.WARNING, logger="blink_horovod.planner.cache"):
        found = cache.lookup_plan(topo, "allreduce", cache_dir=cache_dir)
    seconds = time.monotonic() - t0
    assert [r for r in caplog.records if "corrupt" in r.getMessage()] == []
    if existing:
        assert found is not None and found.rate_gbps == 11.0
        assert valid_entries(cache_dir) == [entry_path(cache_dir)]
    else:
        assert found is None
        assert valid_entries(cache_dir) == []
    # The killed writer's temporary file is an orphan; once older than any live write
    # could be, the next write of the folder removes it.
    orphans = sorted(cache_dir.glob(".*.tmp"))
    assert len(orphans) == 1
    stale = time.time() - 2 * cache.ORPHAN_SECONDS
    for p in orphans:
        os.utime(p, (stale, stale))
    # A later writer succeeds, is read back, and sweeps the orphan.
    assert cache.store_plan(cpu3_allreduce_plan(rate=33.0), topo, "allreduce", cache_dir=cache_dir)
    assert cache.lookup_plan(topo, "allreduce", cache_dir=cache_dir).rate_gbps == 33.0
    assert list(cache_dir.glob(".*.tmp")) == []
    record(
        case=f"plan cache: writer killed midway ({'overwriting an entry' if existing else 'new entry'})",
        fault="plan cache writer SIGKILLed",
        injected="json.dump in the writer process writes half the entry, fsyncs, sleeps; SIGKILL",
        behaviour=(
            ("old entry still whole and read back" if existing else "no entry: the next lookup is a miss")
            + "; no torn *.json; the killed writer's temporary file is removed by the next write"
            + f" once older than {cache.ORPHAN_SECONDS:g} s"
        ),
        seconds=seconds,
    )


CORRUPTIONS = {
    "truncated": lambda good: good[: len(good) // 2],
    "empty": lambda good: "",
    "binary": lambda good: "\udcff\udcfe\x00garbage",
    "not-an-entry": lambda good: json.dumps({"format": "blink-plan/1"}),
    "other-key": lambda good: json.dumps(dict(json.loads(good), key={"topology": "x"})),
    "invalid-plan": lambda good: good.replace('"fraction": 0.3333333333333333', '"fraction": 0.9', 1),
    "deep-nesting": lambda good: "[" * 100000,
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_entry_is_ignored_with_a_warning_and_rebuilt(tmp_path: Path, kind: str, record, caplog) -> None:
    cache_dir = tmp_path / "plans"
    topo = resolve(TOPOLOGY)
    path = cache.store_plan(cpu3_allreduce_plan(), topo, "allreduce", cache_dir=cache_dir)
    good = path.read_text()
    bad = CORRUPTIONS[kind](good)
    path.write_bytes(bad.encode("utf-8", "surrogateescape"))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="blink_horovod.planner.cache"):
        assert cache.lookup_plan(topo, "allreduce", cache_dir=cache_dir) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("ignoring" in w and str(path) in w for w in warnings), warnings
    try:
        from blink_horovod.planner import make_plan
    except ImportError:
        make_plan = None
    if make_plan is not None:
        first = cache.get_plan(topo, "allreduce", cache_dir=cache_dir)
        assert not first.hit and first.path == path
        second = cache.get_plan(topo, "allreduce", cache_dir=cache_dir)
        assert second.hit and second.plan == first.plan
        rebuilt = "rebuilt by get_plan (miss, planned, stored), next get_plan is a hit"
    else:
        # No planner in this checkout yet: rebuild the entry the way get_plan does after a miss.
        cache.store_plan(cpu3_allreduce_plan(), topo, "allreduce", cache_dir=cache_dir)
        assert cache.lookup_plan(topo, "allreduce", cache_dir=cache_dir) == cpu3_allreduce_plan()
        rebuilt = "rewritten by store_plan (make_plan not in this checkout), next lookup is a hit"
    record(
        case=f"plan cache: corrupt entry ({kind})",
        fault="corrupt plan cache entry",
        injected=f"entry file overwritten: {kind}",
        behaviour=f"lookup ignores it with a warning naming the file; {rebuilt}",
        seconds=time.monotonic() - t0,
    )


HAMMER = textwrap.dedent(
    """
    import sys
    from blink_horovod.planner import cache
    from blink_horovod.planner.plan import Plan
    from blink_horovod.topology.machines import resolve
    topo = resolve({topology!r})
    plan = Plan.from_json(sys.argv[2])
    for _ in range(int(sys.argv[3])):
        assert cache.store_plan(plan, topo, "allreduce", None, None, sys.argv[1])
    """
)


def test_concurrent_writers_and_readers_never_see_a_torn_entry(tmp_path: Path, record, caplog) -> None:
    cache_dir = tmp_path / "plans"
    topo = resolve(TOPOLOGY)
    rates = (1.0, 2.0, 3.0)
    script = HAMMER.format(topology=TOPOLOGY)
    writers = [
        subprocess.Popen([sys.executable, "-c", script, str(cache_dir), cpu3_allreduce_plan(rate).to_json(indent=None), "150"],
                         stderr=subprocess.PIPE, text=True)
        for rate in rates
    ]
    seen: set[float] = set()
    reads = 0
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="blink_horovod.planner.cache"):
        while any(w.poll() is None for w in writers) and time.monotonic() - t0 < 90:
            plan = cache.lookup_plan(topo, "allreduce", cache_dir=cache_dir)
            reads += 1
            if plan is not None:
                seen.add(plan.rate_gbps)
    for w in writers:
        _, err = w.communicate(timeout=30)
        assert w.returncode == 0, err
    assert [r.getMessage() for r in caplog.records] == []  # no torn or corrupt entry was ever read
    assert seen <= set(rates) and seen
    assert valid_entries(cache_dir) == [entry_path(cache_dir)]
    assert list(cache_dir.glob(".*.tmp")) == []
    record(
        case="plan cache: 3 concurrent writers of one key, 1 reader",
        fault="concurrent plan cache writers",
        injected="3 processes x 150 store_plan of one key while this process reads it",
        behaviour=f"{reads} reads, none torn or corrupt; one whole entry at the end; no temporary files left",
        seconds=time.monotonic() - t0,
    )
