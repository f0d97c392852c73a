"""Pipeline stages across Ray nodes: rank order and every refusal, over recorded node facts
(the seed-002 fleet: 2 x RTX 5080 in box1, 2 x RTX 4070 Ti SUPER in box2)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from vllm_dualgpu.planner.cluster import (
    ClusterRefused,
    NodeFacts,
    best_plan,
    cluster_problems,
    ifname_usable,
    plan_cards,
    rank_orders,
    refuse_if_any,
)

from pathlib import Path

FLEET = Path(__file__).parents[2] / "fixtures" / "ray_fleet_seed002.json"
MIB = 1 << 20


@pytest.fixture
def fleet() -> list[NodeFacts]:
    return [NodeFacts.from_dict(d) for d in json.loads(FLEET.read_text())["nodes"]]


def whole(nodes):
    return {n.node_id: len(n.gpus) for n in nodes}


def test_recorded_form_round_trips(fleet):
    again = [NodeFacts.from_dict(json.loads(json.dumps(n.to_dict()))) for n in fleet]
    assert again == fleet


def test_recorded_form_keeps_each_cards_display(fleet):
    """The display state picks a card's default reserve on the executor's side: a replay of
    the plan file must see it too."""
    n = fleet[0]
    shown_states = replace(n, gpus=(replace(n.gpus[0], display=True), replace(n.gpus[1], display=False)))
    again = NodeFacts.from_dict(json.loads(json.dumps(shown_states.to_dict())))
    assert [g.display for g in again.gpus] == [True, False]


def shown(order):
    return [(n.hostname, g.index) for n, g in order]


def test_seed002_orders_keep_hosts_together_the_most_free_card_last_first(fleet):
    # box2's card 0 has the most free memory (16020 MiB): the first order puts box2 last and
    # that card last of all, box1's cards smallest first (15610 then 15890 MiB); the other
    # order of the two hosts is planned too (as `plan --fleet` does).
    assert [shown(o) for o in rank_orders(fleet)] == [
        [("box1", 0), ("box1", 1), ("box2", 1), ("box2", 0)],
        [("box2", 1), ("box2", 0), ("box1", 0), ("box1", 1)],
    ]


def test_first_order_follows_free_memory_not_the_order_nodes_answered(fleet):
    box1, box2 = fleet
    roomy = replace(box1, gpus=(box1.gpus[0], replace(box1.gpus[1], free_bytes=16200 * MIB)))
    assert shown(rank_orders([box2, roomy])[0]) == [("box2", 1), ("box2", 0), ("box1", 0), ("box1", 1)]


def test_every_order_of_up_to_four_nodes_then_one(fleet):
    box = fleet[0]
    nodes = [replace(box, node_id=str(i) * 56, ip=f"10.0.0.{i}") for i in range(1, 6)]
    assert len(rank_orders(nodes[:3])) == 6 and len(rank_orders(nodes[:4])) == 24
    assert len(rank_orders(nodes)) == 1


def test_plan_cards_index_by_rank_with_the_budgets_inputs(fleet):
    cards = plan_cards(rank_orders(fleet)[0], [1 << 30] * 4, [10 << 30] * 4)
    assert [c.index for c in cards] == [0, 1, 2, 3]
    assert [c.free_bytes // MIB for c in cards] == [15610, 15890, 15750, 16020]
    # the planner's one budget rule: free - reserve, at most the cap
    assert [c.budget_bytes for c in cards] == [min(c.free_bytes - (1 << 30), 10 << 30) for c in cards]


def test_a_sound_fleet_has_no_problems(fleet):
    assert cluster_problems(fleet, whole(fleet), 4) == []
    assert cluster_problems(fleet, None, 4) == []


def test_unreachable_node_is_named_with_what_to_check(fleet):
    dead = NodeFacts("c" * 56, "10.0.0.13", error="no answer within 60 s")
    problems = cluster_problems([*fleet, dead], None, 4)
    assert len(problems) == 1
    assert "10.0.0.13" in problems[0] and "no answer within 60 s" in problems[0]
    assert "ray status" in problems[0]
    with pytest.raises(ClusterRefused) as e:
        refuse_if_any(problems)
    assert str(e.value).count("\n") == 0


def test_too_few_gpus(fleet):
    problems = cluster_problems(fleet, None, 6)
    assert len(problems) == 1 and "6 ranks need 6 GPUs" in problems[0] and "have 4" in problems[0]


def test_unreachable_and_too_few_both_listed_first_line_first(fleet):
    dead = NodeFacts("c" * 56, "10.0.0.13", error="NVML: Driver Not Loaded")
    with pytest.raises(ClusterRefused) as e:
        refuse_if_any(cluster_problems([fleet[0], dead], None, 4))
    first, *rest = str(e.value).splitlines()
    assert "10.0.0.13" in first and "(and 1 more below)" in first
    assert len(rest) == 1 and "have 2" in rest[0]


def test_placement_group_holding_part_of_a_node(fleet):
    problems = cluster_problems(fleet, {fleet[0].node_id: 1, fleet[1].node_id: 2}, 3)
    assert len(problems) == 1 and "holds 1 of its 2 GPUs" in problems[0] and "box1" in problems[0]


def test_loopback_address_refused_only_across_hosts(fleet):
    lo = replace(fleet[0], ip="127.0.0.1")
    problems = cluster_problems([lo, fleet[1]], None, 4)
    assert len(problems) == 1 and "loopback address 127.0.0.1" in problems[0]
    assert "--node-ip-address" in problems[0]
    # two emulated nodes on one host share the address: NCCL stays on that host
    same = [lo, replace(fleet[1], ip="127.0.0.1")]
    assert cluster_problems(same, None, 4) == []


def test_socket_ifname_naming_an_interface_a_node_lacks(fleet):
    # box1 has enp5s0, box2 eno1: the engine's NCCL_SOCKET_IFNAME=enp5s0 reaches box2 too
    problems = cluster_problems(fleet, None, 4, driver_env={"NCCL_SOCKET_IFNAME": "enp5s0"})
    assert len(problems) == 1 and "box2" in problems[0] and "NCCL_SOCKET_IFNAME=enp5s0" in problems[0]
    assert "the engine's" in problems[0]
    # a node's own setting wins over the engine's
    own = replace(fleet[1], env={"NCCL_SOCKET_IFNAME": "eno"})
    assert cluster_problems([fleet[0], own], None, 4, driver_env={"NCCL_SOCKET_IFNAME": "enp5s0"}) == []
    bad_gloo = replace(fleet[0], env={"GLOO_SOCKET_IFNAME": "ib0"})
    problems = cluster_problems([bad_gloo, fleet[1]], None, 4)
    assert len(problems) == 1 and "GLOO_SOCKET_IFNAME=ib0 (its own)" in problems[0]


@pytest.mark.parametrize("spec, usable", [
    ("eno", ["eno1"]),
    ("=eno", []),
    ("=eno1", ["eno1"]),
    ("^docker,lo", ["eno1"]),
    ("^=docker0", ["lo", "eno1"]),
    ("enp,eno", ["eno1"]),
])
def test_ifname_syntax_is_nccls(spec, usable):
    assert ifname_usable(spec, ("lo", "eno1", "docker0")) == usable


def test_gloo_takes_exact_names_only(fleet):
    assert ifname_usable("eno", ("lo", "eno1"), "GLOO_SOCKET_IFNAME") == []
    assert ifname_usable("eno1,lo", ("lo", "eno1"), "GLOO_SOCKET_IFNAME") == ["lo", "eno1"]
    problems = cluster_problems(fleet, None, 4, driver_env={"GLOO_SOCKET_IFNAME": "en"})
    assert len(problems) == 2 and all("GLOO_SOCKET_IFNAME=en " in p for p in problems)


def test_a_node_numbering_its_cards_unlike_nvml(fleet):
    fast = replace(fleet[1], env={"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    problems = cluster_problems([fleet[0], fast], None, 4)
    assert len(problems) == 1 and "box2" in problems[0] and "CUDA_DEVICE_ORDER=FASTEST_FIRST" in problems[0]
    pci = replace(fleet[1], env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert cluster_problems([fleet[0], pci], None, 4) == []


@pytest.mark.parametrize("key", ["vllm", "torch", "nccl"])
def test_release_mismatch_across_nodes(fleet, key):
    other = replace(fleet[1], versions={**fleet[1].versions, key: "9.9.9"})
    problems = cluster_problems([fleet[0], other], None, 4)
    assert len(problems) == 1 and problems[0].startswith(f"{key} differs across nodes")
    assert "9.9.9 on box2" in problems[0]


def test_tp_group_spanning_hosts(fleet):
    three = replace(fleet[1], gpus=fleet[1].gpus + (replace(fleet[1].gpus[0], index=2),))
    problems = cluster_problems([fleet[0], three], None, 4, tp=2)
    assert len(problems) == 1 and "box2" in problems[0] and "groups of 2" in problems[0]
    assert cluster_problems(fleet, None, 4, tp=2) == []


def test_the_fleet_compares_pools_in_tokens_not_blocks():
    """Each order's plan has its split's KV grouping: 400 blocks of which a 65,536-token request
    takes 200 hold fewer tokens than 300 blocks of which it takes 100."""
    from types import SimpleNamespace

    many_blocks = SimpleNamespace(num_blocks=400, pool_tokens=400 * 65536 // 200, predicted_decode_ms=9.0)
    more_tokens = SimpleNamespace(num_blocks=300, pool_tokens=300 * 65536 // 100, predicted_decode_ms=10.0)
    assert best_plan([many_blocks, more_tokens]) is more_tokens
