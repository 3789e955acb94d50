"""How many ranks' bundles a cluster's nodes hold (`meshfit.launch.ray_placement`): an elastic Ray restart's size."""

import pytest

from meshfit.launch.ray_placement import bundles_per_node, placeable

ONE_CPU = {"CPU": 1}


def test_a_node_holds_as_many_bundles_as_its_scarcest_resource_allows():
    assert bundles_per_node({"CPU": 8, "GPU": 2, "memory": 1e9}, {"CPU": 2, "GPU": 1}) == 2
    assert bundles_per_node({"CPU": 8}, {"CPU": 2, "GPU": 1}) == 0  # no GPU on the node
    assert bundles_per_node({"CPU": 0.3}, {"CPU": 0.1}) == 3  # fractions: 0.3 / 0.1 is 2.9999999999999996


@pytest.mark.parametrize(
    "strategy, expected",
    [("PACK", 4), ("SPREAD", 4), ("STRICT_PACK", 3), ("STRICT_SPREAD", 2)],
)
def test_the_strategy_decides_how_the_nodes_bundles_add_up(strategy, expected):
    nodes = [{"CPU": 3}, {"CPU": 1}, {"CPU": 0}]  # a head without CPUs counts for nothing
    assert placeable(nodes, ONE_CPU, strategy, wanted=8) == expected


def test_no_more_than_wanted_and_none_on_a_cluster_without_the_resource():
    assert placeable([{"CPU": 1}] * 5, ONE_CPU, "PACK", wanted=3) == 3
    assert placeable([{"CPU": 4}], {"GPU": 1}, "PACK", wanted=3) == 0
    assert placeable([], ONE_CPU, "STRICT_PACK", wanted=3) == 0
    assert placeable([{"CPU": 0}], {"CPU": 0}, "PACK", wanted=3) == 3  # a bundle asking nothing fits anywhere
