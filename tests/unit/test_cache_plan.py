"""The plan cache: keys, atomic entries, corrupt entries rebuilt, hits without the planner.

Tests that need a plan to be *made* (a miss) run the real planner and skip
while ``blink_horovod.planner.make_plan`` is not in this checkout; the others
store a hand-written valid plan and read it back.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blink_horovod.errors import PlanError
from blink_horovod.planner.cache import (
    ENTRY_FORMAT,
    cache_key,
    cached_plan,
    get_plan,
    lookup_plan,
    planner_version,
    store_plan,
)
from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.topology import Topology, machine, resolve

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]

try:
    from blink_horovod.planner import make_plan  # noqa: F401

    HAS_PLANNER = True
except ImportError:
    HAS_PLANNER = False
needs_planner = pytest.mark.skipif(not HAS_PLANNER, reason="blink_horovod.planner.make_plan is not in this checkout yet")


def chain_plan(topo: Topology) -> Plan:
    """A valid (not optimal) dgx1v broadcast plan: one tree over direct links."""
    edges = ((0, 3), (3, 2), (2, 1), (0, 4), (4, 7), (7, 6), (6, 5))
    return Plan("broadcast", topo.name, topo.gpus, 0, (Tree(0, 1.0, edges),), 25.0, 150.0, channels=("nvlink",))


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.suffix == ".json")


def test_key_depends_on_content_collective_root_channels_not_name() -> None:
    dgx = machine("dgx1v")
    same = Topology.from_dict({**dgx.to_dict(), "name": "my-dgx"})
    base = cache_key(dgx, "broadcast", 0, ["nvlink"])
    assert cache_key(same, "broadcast", 0, ["nvlink"]) == base  # name is not content
    assert cache_key(dgx, "broadcast", 0, ("nvlink",)) == base
    others = {
        cache_key(dgx, "allreduce", None, ["nvlink"]),
        cache_key(dgx, "broadcast", 1, ["nvlink"]),
        cache_key(dgx, "broadcast", 0, ["nvlink", "pcie"]),
        cache_key(dgx, "broadcast", 0, None),
        cache_key(dgx.allocate([0, 1, 2, 3]), "broadcast", 0, ["nvlink"]),
        cache_key(machine("dgx1p"), "broadcast", 0, ["nvlink"]),
    }
    assert base not in others and len(others) == 6
    assert cache_key(dgx, "broadcast", 0, ["pcie", "nvlink"]) == cache_key(dgx, "broadcast", 0, ["nvlink", "pcie"])


def test_planner_version_names_the_package_version_and_a_source_hash() -> None:
    import blink_horovod

    version = planner_version()
    assert version.startswith(blink_horovod.__version__ + "+") and len(version.split("+")[1]) == 16


@pytest.mark.parametrize("bad", [["infiniband"], [], ["nvlink", "nvlink"]])
def test_bad_channels_are_rejected(bad: list[str]) -> None:
    with pytest.raises(PlanError, match="channels"):
        cache_key(machine("dgx1v"), "broadcast", 0, bad)


def test_stored_plan_is_found_without_planning_and_takes_the_requested_name(tmp_path: Path) -> None:
    dgx = machine("dgx1v")
    plan = chain_plan(dgx)
    path = store_plan(plan, dgx, "broadcast", 0, ["nvlink"], cache_dir=tmp_path)
    assert path is not None and path.parent == tmp_path and entries(tmp_path) == [path]
    entry = json.loads(path.read_text())
    assert entry["format"] == ENTRY_FORMAT and entry["key"]["planner"] == planner_version()
    assert list(tmp_path.glob(".*.tmp")) == []  # the temporary file was renamed away
    result = get_plan(dgx, "broadcast", 0, ["nvlink"], cache_dir=tmp_path)
    assert result.hit and result.plan == plan
    renamed = Topology.from_dict({**dgx.to_dict(), "name": "my-dgx"})
    again = cached_plan(renamed, "broadcast", 0, ["nvlink"], cache_dir=tmp_path)
    assert again.topology == "my-dgx" and again.trees == plan.trees


def test_store_rejects_a_plan_that_does_not_answer_the_request(tmp_path: Path) -> None:
    dgx = machine("dgx1v")
    with pytest.raises(PlanError):
        store_plan(chain_plan(dgx), dgx, "allreduce", None, None, cache_dir=tmp_path)
    with pytest.raises(PlanError):
        store_plan(chain_plan(dgx), dgx.allocate([0, 1, 2, 3]), "broadcast", 0, None, cache_dir=tmp_path)


def test_default_folder_is_blink_plan_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLINK_PLAN_CACHE", str(tmp_path / "plans"))
    dgx = machine("dgx1v")
    path = store_plan(chain_plan(dgx), dgx, "broadcast", 0, ["nvlink"])
    assert path is not None and path.parent == tmp_path / "plans"
    assert lookup_plan(dgx, "broadcast", 0, ["nvlink"]) == chain_plan(dgx)


def _edit(change):
    def apply(text: str) -> str:
        entry = json.loads(text)
        change(entry)
        return json.dumps(entry)

    return apply


def _bad_tree(entry: dict) -> None:
    entry["plan"]["trees"][0]["edges"][-1] = [6, 6]  # GPU 5 no longer reached


CORRUPTIONS = {
    "truncated": lambda text: text[: len(text) // 2],
    "not json": lambda text: "\x00\x01garbage",
    "empty": lambda text: "",
    "binary": None,  # bytes that are not UTF-8, written below
    "other key": _edit(lambda e: e["key"].update(collective="allreduce")),
    "other planner": _edit(lambda e: e["key"].update(planner="0.0.0+old")),
    "bad tree": _edit(_bad_tree),
    "fractions": _edit(lambda e: e["plan"]["trees"][0].update(fraction=0.5)),
    "wrong format": _edit(lambda e: e.update(format="blink-plan-cache/0")),
    "plan missing": _edit(lambda e: e.pop("plan")),
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_corrupt_entry_is_ignored_with_a_warning(how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dgx = machine("dgx1v")
    path = store_plan(chain_plan(dgx), dgx, "broadcast", 0, ["nvlink"], cache_dir=tmp_path)
    assert path is not None
    if how == "binary":
        path.write_bytes(b"\xff\xfe\x00\x89")
    else:
        changed = CORRUPTIONS[how](path.read_text())  # type: ignore[misc]
        assert changed != path.read_text()
        path.write_text(changed)
    with caplog.at_level(logging.WARNING, logger="blink_horovod.planner.cache"):
        assert lookup_plan(dgx, "broadcast", 0, ["nvlink"], cache_dir=tmp_path) is None
    assert "plan cache: ignoring" in caplog.text and str(path) in caplog.text


def test_unwritable_cache_costs_only_the_caching(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    dgx = machine("dgx1v")
    with caplog.at_level(logging.WARNING, logger="blink_horovod.planner.cache"):
        assert store_plan(chain_plan(dgx), dgx, "broadcast", 0, ["nvlink"], cache_dir=blocker / "plans") is None
    assert "plan not cached" in caplog.text


def test_a_cache_hit_does_not_import_the_planner(tmp_path: Path) -> None:
    dgx = machine("dgx1v")
    store_plan(chain_plan(dgx), dgx, "broadcast", 0, ["nvlink"], cache_dir=tmp_path)
    code = (
        "import sys\n"
        "import blink_horovod.planner.cache as cache\n"
        "from blink_horovod.topology import machine\n"
        "before = set(sys.modules)\n"
        f"r = cache.get_plan(machine('dgx1v'), 'broadcast', 0, ['nvlink'], cache_dir={str(tmp_path)!r})\n"
        "assert r.hit, r\n"
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('cvxpy', 'scipy', 'networkx', 'highspy')"
        " or m.startswith('blink_horovod.planner.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    # A hit imports no planner module and no solver beyond what the package import itself did.
    assert proc.stdout.strip() == "[]", proc.stdout


@needs_planner
def test_miss_plans_stores_and_then_hits(tmp_path: Path) -> None:
    topo = resolve("dgx1v:0,1,2,3")
    first = get_plan(topo, "broadcast", 0, ["nvlink"], cache_dir=tmp_path)
    assert not first.hit and first.path is not None and first.path.exists()
    second = get_plan(topo, "broadcast", 0, ["nvlink"], cache_dir=tmp_path)
    assert second.hit and second.plan.to_dict() == first.plan.to_dict()


@needs_planner
def test_corrupt_entry_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    topo = resolve("dgx1v:0,1,2,3")
    first = get_plan(topo, "allreduce", None, ["nvlink"], cache_dir=tmp_path)
    assert first.path is not None
    first.path.write_text('{"format": "blink-plan-cache/1", "key": {}, "plan": 7')
    with caplog.at_level(logging.WARNING, logger="blink_horovod.planner.cache"):
        again = get_plan(topo, "allreduce", None, ["nvlink"], cache_dir=tmp_path)
    assert not again.hit and "ignoring corrupt entry" in caplog.text
    assert again.plan.to_dict() == first.plan.to_dict()
    assert get_plan(topo, "allreduce", None, ["nvlink"], cache_dir=tmp_path).hit  # rewritten whole
