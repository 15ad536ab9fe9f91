"""The topology model: built-in machines, allocations, validation of bad input."""

from __future__ import annotations

import json
import math

import pytest

from blink_horovod.errors import TopologyError
from blink_horovod.topology import Topology, machine, resolve
from blink_horovod.topology.machines import parse_gpu_list


def _degree_gbps(topo: Topology, gpu: int) -> float:
    return sum(bw for (a, b), bw in topo.capacities().items() if gpu in (a, b))


def test_dgx1v_has_six_nvlinks_of_25_per_gpu() -> None:
    topo = machine("dgx1v")
    for g in topo.gpus:
        assert _degree_gbps(topo, g) == pytest.approx(150.0)
        assert sum(topo.link_count(g, h) for h in topo.gpus if h != g) == 6
    assert topo.capacities()[(0, 3)] == 50.0 and topo.capacities()[(0, 1)] == 25.0


def test_dgx1p_is_a_hybrid_cube_mesh_of_single_links() -> None:
    topo = machine("dgx1p")
    caps = topo.capacities()
    assert len(caps) == 16 and set(caps.values()) == {20.0}
    assert (0, 4) in caps and (0, 5) not in caps


@pytest.mark.parametrize("name,n,port", [("dgx2", 16, 150.0), ("hgx-h100", 8, 450.0), ("hgx-h200", 8, 450.0)])
def test_switched_machines_route_every_gpu_through_one_switch(name: str, n: int, port: float) -> None:
    topo = machine(name)
    assert topo.n == n and topo.switches == ("nvswitch0",)
    for g in topo.gpus:
        assert topo.capacities()[(g, "nvswitch0")] == port


def test_allocation_keeps_only_links_among_allocated_gpus() -> None:
    topo = resolve("dgx1v:0,1,4,5")
    assert topo.gpus == (0, 1, 4, 5)
    assert topo.capacities() == {(0, 1): 25.0, (0, 4): 50.0, (1, 5): 50.0, (4, 5): 25.0}
    assert topo.pcie is not None and topo.pcie.switch_groups == ((0, 1), (4, 5))
    assert resolve("dgx1v", gpus="0,1,4,5") == topo


def test_round_trip_through_json() -> None:
    for name in ("dgx1v", "dgx2", "pcie4", "cpu3"):
        topo = machine(name)
        again = Topology.from_json(topo.to_json())
        assert again == topo
        assert again.content_hash() == topo.content_hash()


def test_content_hash_ignores_the_name_but_not_the_links() -> None:
    a = machine("dgx1v").to_dict()
    b = dict(a, name="renamed")
    assert Topology.from_dict(a).content_hash() == Topology.from_dict(b).content_hash()
    c = json.loads(json.dumps(a))
    c["links"][0]["bandwidth_gbps"] = 49.0
    assert Topology.from_dict(c).content_hash() != Topology.from_dict(a).content_hash()


BAD = [
    ({"format": "blink-topology/9", "gpus": [0], "links": []}, "format"),
    ({"gpus": [], "links": []}, "gpus"),
    ({"gpus": [0, 0], "links": []}, "gpus"),
    ({"gpus": [0, 1], "links": [{"src": 0, "dst": 7, "bandwidth_gbps": 25}]}, "links[0].dst"),
    ({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": 0}]}, "links[0].bandwidth_gbps"),
    ({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": -3}]}, "links[0].bandwidth_gbps"),
    ({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": math.nan}]}, "links[0].bandwidth_gbps"),
    ({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": 25, "kind": "wifi"}]}, "links[0].kind"),
    ({"gpus": [0, 1], "links": [{"src": 0, "dst": 0, "bandwidth_gbps": 25}]}, "links[0]"),
    ({"gpus": [0, 1], "links": [], "pcie": {"bandwidth_gbps": 12, "switch_groups": [[0, 5]]}}, "pcie.switch_groups[0]"),
]


@pytest.mark.parametrize("data,field", BAD)
def test_bad_topologies_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(TopologyError) as err:
        Topology.from_dict(data)
    assert str(err.value).startswith(field)


def test_malformed_json_names_the_position() -> None:
    with pytest.raises(TopologyError, match="line 1 column"):
        Topology.from_json('{"gpus": [0,', source="t.json")


@pytest.mark.parametrize("spec", ["dgx9", "dgx1v:0,0", "dgx1v:", "dgx1v:0,9", "dgx1v:a,b", "nofile.json"])
def test_bad_specs_raise_topology_errors(spec: str) -> None:
    with pytest.raises(TopologyError):
        resolve(spec)


def test_gpus_flag_must_agree_with_the_allocation() -> None:
    with pytest.raises(TopologyError, match="disagrees"):
        resolve("dgx1v:0,1", gpus=[0, 2])


def test_parse_gpu_list() -> None:
    assert parse_gpu_list("3, 1,2") == [3, 1, 2]
    with pytest.raises(TopologyError, match="duplicate"):
        parse_gpu_list("1,1")
