"""Fuzzing of every parser of user input: it parses, or it raises the project's own error.

Reliability requirement ("Bad input"): the topology, plan and config parsers are fuzzed with
hypothesis; every input either parses or raises the matching
:class:`~blink_horovod.errors.BlinkError` subclass (``TopologyError``,
``PlanError``, ``ConfigError``), never a ``TypeError``, ``OverflowError``,
``RecursionError`` or other accident of the implementation.  Anything else
escapes the ``except`` clauses below and hypothesis reports the shrunk input.

Inputs come from two sources: arbitrary JSON-like values (the parser must not
assume any shape), and *mutations of valid documents* (built-in machines and
plans with one field replaced, deleted or duplicated), which reach the deep
validation code that arbitrary values never get past.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from blink_horovod.config import ALL_VARIABLES, load_config
from blink_horovod.errors import ConfigError, PlanError, TopologyError
from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.topology.machines import MACHINES, machine, parse_gpu_list, resolve
from blink_horovod.topology.model import Topology
from blink_horovod.units import parse_size

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(
    max_examples=int(os.environ.get("BLINK_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies -----------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**63, 10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.text(max_size=8), inner, max_size=5),
    ),
    max_leaves=25,
)

# Built-in machines small enough to mutate quickly, and allocations of them.
SMALL_TOPOLOGIES = [machine(n) for n in ("dgx1p", "dgx1v", "hgx-h100", "pcie4", "cpu3")] + [
    machine("dgx1v").allocate([0, 1, 4, 5]),
    machine("dgx2").allocate([0, 3, 7]),
]


def _valid_plans() -> list[Plan]:
    """Hand-built valid plans (these need no solver)."""
    bc = Plan(
        collective="broadcast", topology="cpu3", gpus=(0, 1, 2), root=0,
        trees=(Tree(0, 0.5, ((0, 1), (1, 2))), Tree(0, 0.5, ((0, 2), (0, 1)))),
        rate_gbps=20.0, optimum_gbps=20.0,
    )
    third = 1.0 / 3.0
    ar = Plan(
        collective="allreduce", topology="cpu3", gpus=(0, 1, 2), root=None,
        trees=(
            Tree(0, third, ((0, 1), (1, 2))),
            Tree(1, third, ((1, 2), (1, 0))),
            Tree(2, 1.0 - 2 * third, ((2, 0), (0, 1)), "pcie"),
        ),
        rate_gbps=10.0, optimum_gbps=10.0, channels=("nvlink", "pcie"),
    )
    return [bc, ar]


VALID_PLANS = _valid_plans()


@st.composite
def mutated(draw: st.DrawFn, doc: object, depth: int = 0) -> object:
    """``doc`` with up to three random edits somewhere inside it."""
    doc = json.loads(json.dumps(doc))  # deep copy through JSON
    for _ in range(draw(st.integers(1, 3))):
        doc = _mutate_once(draw, doc)
    return doc


def _mutate_once(draw: st.DrawFn, node: object) -> object:
    # Walk down a random path, then replace, delete or duplicate what is there.
    if isinstance(node, (dict, list)) and node and draw(st.booleans()):
        if isinstance(node, dict):
            key = draw(st.sampled_from(sorted(node)))
            action = draw(st.sampled_from(["descend", "descend", "delete", "replace"]))
            if action == "delete":
                del node[key]
            elif action == "replace":
                node[key] = draw(json_values)
            else:
                node[key] = _mutate_once(draw, node[key])
        else:
            i = draw(st.integers(0, len(node) - 1))
            action = draw(st.sampled_from(["descend", "descend", "delete", "replace", "duplicate"]))
            if action == "delete":
                del node[i]
            elif action == "replace":
                node[i] = draw(json_values)
            elif action == "duplicate":
                node.append(json.loads(json.dumps(node[i])))
            else:
                node[i] = _mutate_once(draw, node[i])
        return node
    return draw(json_values)


topology_docs = st.one_of(
    json_values,
    st.sampled_from(SMALL_TOPOLOGIES).flatmap(lambda t: mutated(t.to_dict())),
)
plan_docs = st.one_of(
    json_values,
    st.sampled_from(VALID_PLANS).flatmap(lambda p: mutated(p.to_dict())),
)


def _texts(docs: st.SearchStrategy) -> st.SearchStrategy[str]:
    """JSON text of ``docs``, plus truncated, deeply nested and non-JSON text."""
    dumped = docs.map(lambda d: json.dumps(d, allow_nan=True))
    return st.one_of(
        dumped,
        st.tuples(dumped, st.integers(0, 400)).map(lambda t: t[0][: t[1]]),
        st.text(max_size=60),
        st.integers(1, 20000).map(lambda n: "[" * n),
        st.integers(4000, 6000).map(lambda n: '{"gpus": [' + "9" * n + "]}"),
        st.sampled_from(["", "null", "NaN", "1e999", '{"gpus": [0], "links": [], "format": 7}']),
    )


# -- topology ----------------------------------------------------------------------


@FUZZ
@given(topology_docs)
@example({"gpus": [0, 1], "links": [{"src": [0], "dst": 1, "bandwidth_gbps": 1}]})
@example({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": 10**400}]})
@example({"gpus": [0, 1], "links": [], "pcie": {"bandwidth_gbps": 1, "switch_groups": [[[0]]]}})
@example({"gpus": [0, 1], "links": [{"src": 0.0, "dst": 1, "bandwidth_gbps": 1}]})
def test_topology_from_dict_parses_or_raises_topology_error(doc: object) -> None:
    try:
        topo = Topology.from_dict(doc)
    except TopologyError as exc:
        assert str(exc), "an error must say what is wrong"
        return
    # What parsed is a valid topology: it survives its own round trip.
    again = Topology.from_json(topo.to_json())
    assert again == topo
    assert all(isinstance(g, int) and not isinstance(g, bool) for g in topo.gpus)
    for link in topo.links:
        for v in (link.src, link.dst):
            assert (isinstance(v, int) and not isinstance(v, bool) and v in topo.gpus) or v in topo.switches


@FUZZ
@given(_texts(topology_docs))
@example("[" * 100000)
@example('{"gpus": [' + "9" * 5000 + "]}")
def test_topology_from_json_parses_or_raises_topology_error(text: str) -> None:
    try:
        Topology.from_json(text, source="fuzz.json")
    except TopologyError:
        pass


def test_topology_from_json_bytes_not_utf8_is_topology_error() -> None:
    with pytest.raises(TopologyError, match="fuzz.json"):
        Topology.from_json(b"\xff\xfe{", source="fuzz.json")  # type: ignore[arg-type]


# -- plan ------------------------------------------------------------------------


@FUZZ
@given(plan_docs)
@example({"collective": "allreduce", "gpus": [0, 1], "trees": [{"root": 0, "fraction": 1, "edges": [[0, 1]]}], "rate_gbps": "x"})
@example({"collective": "allreduce", "gpus": [0, 1], "trees": [{"root": 0, "fraction": 1, "edges": [[0, 1]]}], "channels": 5})
@example({"collective": "broadcast", "gpus": [0, 1], "root": 0, "trees": [{"root": 0, "fraction": 10**400, "edges": [[0, 1]]}]})
def test_plan_from_dict_parses_or_raises_plan_error(doc: object) -> None:
    try:
        plan = Plan.from_dict(doc)
    except PlanError as exc:
        assert str(exc)
        return
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert math.isclose(math.fsum(t.fraction for t in plan.trees), 1.0, abs_tol=1e-6)
    assert set(plan.channels) <= {"nvlink", "pcie"}


@FUZZ
@given(_texts(plan_docs))
@example("1" * 5000)
def test_plan_from_json_parses_or_raises_plan_error(text: str) -> None:
    try:
        Plan.from_json(text)
    except PlanError:
        pass


# -- config and sizes ------------------------------------------------------------------

env_values = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["0", "1", "-1", "nan", "inf", "1e999", "1e5", "64M", "1.5K", "0.5", "9" * 5000, " 3 ", "١"]),
)


@FUZZ
@given(st.dictionaries(st.sampled_from(ALL_VARIABLES), env_values, max_size=len(ALL_VARIABLES)))
def test_load_config_parses_or_raises_config_error(env: dict[str, str]) -> None:
    try:
        cfg = load_config(env)
    except ConfigError as exc:
        # The message names the variable (docs/formats.md, Environment variables).
        assert any(name in str(exc) for name in env), str(exc)
        return
    assert cfg.timeout_seconds > 0 and math.isfinite(cfg.timeout_seconds)
    assert cfg.stall_check_seconds > 0 and math.isfinite(cfg.stall_check_seconds)
    assert cfg.chunk_bytes is None or cfg.chunk_bytes > 0
    assert cfg.local_size is None or cfg.local_size > 0


@FUZZ
@given(st.one_of(env_values, st.integers(-(2**70), 2**70), st.floats(), st.none(), json_values))
def test_parse_size_parses_or_raises_config_error(value: object) -> None:
    try:
        n = parse_size(value, "BLINK_CHUNK_BYTES")  # type: ignore[arg-type]
    except ConfigError as exc:
        assert "BLINK_CHUNK_BYTES" in str(exc)
        return
    assert isinstance(n, int) and n >= 0


# -- machine names, allocations, files ------------------------------------------------------

gpu_list_texts = st.one_of(
    st.text(max_size=20),
    st.lists(st.integers(-3, 20), max_size=9).map(lambda xs: ",".join(map(str, xs))),
    st.lists(st.sampled_from(["0", "1", "4", "5", "", " ", "x", "-1", "07", "9" * 5000]), max_size=5).map(",".join),
)

machine_names = st.one_of(
    st.sampled_from(sorted(MACHINES)),
    st.tuples(st.sampled_from(["cpu", "pcie"]), st.sampled_from(["0", "1", "3", "16", "99999999", "9" * 5000])).map("".join),
    st.text(max_size=12),
)


# Fuzzed topology files live here; hypothesis may draw a file for an example it then
# discards, so the folder (not each test) is what gets removed, when the process ends.
_FILES = tempfile.mkdtemp(prefix="blink-fuzz-files-")
atexit.register(shutil.rmtree, _FILES, True)


@st.composite
def topology_specs(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["name", "alloc", "file", "path", "junk"]))
    if kind == "name":
        return draw(machine_names)
    if kind == "alloc":
        return draw(machine_names) + ":" + draw(gpu_list_texts)
    if kind == "file":
        # A real file with fuzzed content (valid topology, mutated, binary or junk).
        content = draw(st.one_of(_texts(topology_docs).map(str.encode), st.binary(max_size=64)))
        fd, path = tempfile.mkstemp(prefix="blink-fuzz-", suffix=".json", dir=_FILES)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        suffix = draw(st.sampled_from(["", "", ":0,1", ":x"]))
        return path + suffix
    if kind == "path":
        return draw(st.sampled_from(["/", "/nonexistent/topo.json", "missing.json", "/dev/null", "/proc", "a" * 300, "a/" * 3000, "x\x00y"]))
    return draw(st.text(max_size=40))


@FUZZ
@given(topology_specs(), st.one_of(st.none(), gpu_list_texts, st.lists(st.integers(-2, 20), max_size=9), json_values))
def test_resolve_parses_or_raises_topology_error(spec: str, gpus: object) -> None:
    try:
        topo = resolve(spec, gpus)  # type: ignore[arg-type]
    except TopologyError as exc:
        assert str(exc)
    else:
        assert isinstance(topo, Topology)
    finally:
        path = spec.split(":", 1)[0]
        if os.path.basename(path).startswith("blink-fuzz-") and os.path.isfile(path):
            os.unlink(path)


@FUZZ
@given(st.one_of(gpu_list_texts, json_values))
def test_parse_gpu_list_parses_or_raises_topology_error(text: object) -> None:
    try:
        ids = parse_gpu_list(text, "gpus")  # type: ignore[arg-type]
    except TopologyError as exc:
        assert "gpus" in str(exc)
        return
    assert ids and len(set(ids)) == len(ids) and all(isinstance(i, int) and i >= 0 for i in ids)


@pytest.mark.parametrize(
    "spec, gpus",
    [
        ("a" * 300, None),  # ENAMETOOLONG from Path.is_file
        ("x\x00y", None),
        ("cpu", [[]]),  # unhashable GPU id
        ("dgx1v", 5),  # not a list
        ("cpu" + "9" * 5000, None),  # beyond int()'s 4300-digit limit
        ("dgx1v:" + "9" * 5000, None),
    ],
)
def test_resolve_regressions_found_by_fuzzing(spec: str, gpus: object) -> None:
    with pytest.raises(TopologyError):
        resolve(spec, gpus)  # type: ignore[arg-type]


def test_resolve_binary_file_is_topology_error_naming_it(tmp_path) -> None:
    path = tmp_path / "topo.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    with pytest.raises(TopologyError, match="topo.json"):
        resolve(str(path))


def test_sized_machine_too_large_is_refused_quickly() -> None:
    # cpu100000 would build ~5e9 links (hours, all memory): a clear error instead.
    with pytest.raises(TopologyError, match="cpu100000"):
        machine("cpu100000")


# -- the fault-injection hook's variable (BLINK_FAULT) -------------------------------------

fault_texts = st.one_of(
    st.text(max_size=30),
    st.tuples(
        st.sampled_from(["kill", "raise", "stall", "corrupt", "KILL", "explode", ""]),
        st.lists(
            st.tuples(st.sampled_from(["after", "rank", "seconds", "bogus", ""]),
                      st.sampled_from(["=", "", "=="]),
                      st.one_of(st.sampled_from(["0", "3", "-1", "x", "1.5", "nan", "inf", "9" * 5000, ""]), st.text(max_size=4)))
            .map("".join),
            max_size=4,
        ),
    ).map(lambda t: ":".join([t[0], *t[1]])),
)


@FUZZ
@given(fault_texts)
@example("stall:after=1:seconds=nan")
@example("stall:after=1:seconds=-1")
@example("kill:after=" + "9" * 5000)
def test_parse_fault_parses_or_raises_config_error(text: str) -> None:
    try:
        from blink_horovod.runtime.faults import FAULT_ACTIONS, parse_fault
    except ImportError:
        pytest.skip("the runtime's fault hook is not in this checkout yet")
    try:
        spec = parse_fault(text)
    except ConfigError as exc:
        assert "BLINK_FAULT" in str(exc)
        return
    assert spec.action in FAULT_ACTIONS and spec.after >= 0
    assert spec.rank is None or spec.rank >= 0
    assert math.isfinite(spec.seconds) and spec.seconds >= 0, spec
