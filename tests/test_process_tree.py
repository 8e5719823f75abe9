"""The process tree the launch helpers kill: read from /proc one process at a time."""

from __future__ import annotations

import pytest

from reference_impl.launch import descendants_in


@pytest.mark.timeout(10)
def test_a_snapshot_with_a_loop_from_a_reused_pid_still_gives_each_descendant_once() -> None:
    """20 started 21, which started 22; 20 ended and a child of 21 got its pid while /proc
    was being read, so the snapshot has 20 -> 21 -> 20. The walk must end."""
    parents = {20: 21, 21: 20, 22: 21, 30: 1}
    assert descendants_in(parents, 20) == [21, 22]


def test_descendants_come_nearest_first_and_never_include_the_root_or_strangers() -> None:
    parents = {2: 1, 3: 2, 4: 2, 5: 3, 6: 1, 7: 6}
    assert descendants_in(parents, 2) == [3, 4, 5]
    assert descendants_in(parents, 5) == []
