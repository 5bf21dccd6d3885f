"""data_shards: collisions that are exactly r vs r + local world size name the local index; others stay generic."""

from __future__ import annotations

from distdiag.probes.data.probe import local_index_size


def _local(world: int, per_node: int) -> dict[int, list[int]]:
    return {r: [r % per_node, per_node] for r in range(world)}


def test_every_local_rank_colliding_across_nodes_is_the_local_index():
    assert local_index_size([[0, 2], [1, 3]], _local(4, 2), 4) == 2
    assert local_index_size([[0, 2, 4], [1, 3, 5]], _local(6, 2), 6) == 2
    assert local_index_size([[0, 4], [1, 5], [2, 6], [3, 7]], _local(8, 4), 8) == 4


def test_other_collisions_are_not_called_local():
    assert local_index_size([[0, 1, 2, 3]], _local(4, 2), 4) is None  # every rank the same data: no sampler at all
    assert local_index_size([[0, 2]], _local(4, 2), 4) is None  # one local rank only: not every rank collides
    assert local_index_size([[0, 1], [2, 3]], _local(4, 2), 4) is None  # within a node
    assert local_index_size([[0, 2], [1, 3]], _local(4, 4), 4) is None  # one node: no other node to repeat on
    assert local_index_size([[0, 2], [1, 3]], {0: None, 1: None, 2: None, 3: None}, 4) is None  # not known
