"""Fleet parsing, TP grouping and the topologies enumerated for a fleet (no planning yet)."""

from __future__ import annotations

import pytest

from vllm_dualgpu.planner import BadRequest
from vllm_dualgpu.planner.gpus import GIB
from vllm_dualgpu.planner.topology import Host, enumerate_layouts, fleet_from_dict, group_host, parse_fleet

SEED = "box1=RTX 5080,RTX 5080;box2=RTX 4070 Ti SUPER,RTX 4070 Ti SUPER"


def test_hosts_split_on_semicolons_and_get_default_names():
    f = parse_fleet("RTX 5080,RTX 5080;RTX 4070 Ti SUPER,RTX 4070 Ti SUPER")
    assert [h.name for h in f.hosts] == ["host1", "host2"]
    assert [[g.index for g in h.gpus] for h in f.hosts] == [[0, 1], [0, 1]]  # CUDA order inside each host
    assert [g.short_name for g in f.hosts[1].gpus] == ["RTX 4070 Ti SUPER"] * 2


def test_named_hosts_and_card_keys_are_not_taken_for_names():
    f = parse_fleet("box1=RTX 5080:reserve=1GiB,RTX 5080;box2=RTX 4070 Ti SUPER;")
    assert [h.name for h in f.hosts] == ["box1", "box2"]
    assert f.hosts[0].gpus[0].reserve_bytes == GIB and f.hosts[0].gpus[1].reserve_bytes == 0
    # a card entry's key=value is not a host name (the text before '=' has a space and a colon)
    one = parse_fleet("RTX 5080:reserve=1GiB,RTX 5080;")
    assert [h.name for h in one.hosts] == ["host1"] and len(one.hosts[0].gpus) == 2


@pytest.mark.parametrize("spec", [";", "box1=;box2=RTX 5080", "box1=RTX 5080;box1=RTX 5080", "box1=Mystery Card"])
def test_bad_fleet_strings_are_refused(spec):
    with pytest.raises(BadRequest):
        parse_fleet(spec)


def test_fleet_file_hosts_take_strings_or_lists():
    f = fleet_from_dict({"hosts": [{"name": "a", "gpus": "RTX 5080,RTX 5080"},
                                   {"gpus": ["RTX 4070 Ti SUPER", "RTX 4070 Ti SUPER:16GiB:free=15GiB"]}]})
    assert [h.name for h in f.hosts] == ["a", "host2"]
    assert f.hosts[1].gpus[1].free_bytes == 15 * GIB
    for bad in ({}, {"hosts": []}, {"hosts": [{"name": "a"}]}, {"hosts": [{"name": "a b", "gpus": "RTX 5080"}]},
                {"hosts": [{"gpus": 3}]}):
        with pytest.raises(BadRequest):
            fleet_from_dict(bad)


def test_a_mixed_tp_group_is_refused_with_the_reason():
    host = parse_fleet("mixed=RTX 5090,RTX 4070 Ti SUPER").hosts[0]
    groups, idle, why = group_host(host, 2)
    assert groups == [] and why is not None
    assert why.startswith("mixed TP group") and "RTX 5090" in why and "RTX 4070 Ti SUPER" in why
    assert "pipeline stages" in why  # says what to do instead


def test_too_few_cards_for_a_tp_group_is_refused():
    host = parse_fleet("box1=RTX 5080,RTX 5080").hosts[0]
    groups, idle, why = group_host(host, 4)
    assert groups == [] and why == "too few cards: TP 4 needs 4 cards on one host, box1 has 2"


def test_a_card_without_a_twin_is_left_idle_with_the_reason():
    host = parse_fleet("box=RTX 5080,RTX 4070 Ti SUPER,RTX 5080").hosts[0]
    groups, idle, why = group_host(host, 2)
    assert why is None
    assert [[c.gpu.index for c in g] for g in groups] == [[0, 2]]  # the two 5080s, not adjacent in CUDA order
    assert [(c.gpu.index, "RTX 4070 Ti SUPER" in w) for c, w in idle] == [(1, True)]


def test_cards_of_one_name_but_different_memory_are_not_one_kind():
    host = Host("h", tuple(parse_fleet("h=L4:24GiB,L4:20GiB").hosts[0].gpus))
    groups, idle, why = group_host(host, 2)
    assert groups == [] and why.startswith("mixed TP group")


def test_the_seed_fleet_gives_five_topologies():
    lays = enumerate_layouts(parse_fleet(SEED))
    # TP sizes 1 and 2 (no host has 4 cards); per host, per group, across hosts each; with one
    # TP-2 group per host, "one replica per TP-2 group" is "one replica per host" again.
    assert [lay.id for lay in lays] == ["host-tp1", "group-tp1", "fleet-tp1", "host-tp2", "fleet-tp2"]
    by = {lay.id: lay for lay in lays}
    assert by["host-tp2"].aliases == ("group-tp2",)
    assert [r.name for r in by["host-tp1"].replicas] == ["box1", "box2"]
    assert [len(r.stages) for r in by["host-tp1"].replicas] == [2, 2]  # PP over the host's two cards
    assert [r.name for r in by["group-tp1"].replicas] == ["box1:0", "box1:1", "box2:0", "box2:1"]
    assert [len(s) for s in by["fleet-tp2"].replicas[0].stages] == [2, 2]  # two TP-2 stages
    assert by["fleet-tp1"].replicas[0].name == "box1+box2" and len(by["fleet-tp1"].replicas[0].stages) == 4
    assert all(lay.idle == () for lay in lays)


def test_tp_sizes_can_be_asked_for_and_too_few_cards_shows_as_a_refused_replica():
    lays = enumerate_layouts(parse_fleet(SEED), tp_sizes=[4])
    host = next(lay for lay in lays if lay.id == "host-tp4")
    assert all(r.refusal and r.refusal.startswith("too few cards") for r in host.replicas)
    assert {c.label for c, _ in host.idle} == {"box1:0 RTX 5080", "box1:1 RTX 5080",
                                               "box2:0 RTX 4070 Ti SUPER", "box2:1 RTX 4070 Ti SUPER"}
    with pytest.raises(BadRequest):
        enumerate_layouts(parse_fleet(SEED), tp_sizes=[0])


def test_one_host_has_no_cross_host_topology():
    ids = [lay.id for lay in enumerate_layouts(parse_fleet("RTX 5090,RTX 4070 Ti SUPER"))]
    assert ids == ["host-tp1", "group-tp1", "host-tp2", "group-tp2"]
