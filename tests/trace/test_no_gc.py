"""no_gc hands what its block kept to the oldest generation without a scan, and a full pass still frees the
cycles among it."""
import gc
import weakref

from syntorch.trace.graph import no_gc


class Node:
    pass


def test_kept_objects_skip_the_young_generations_and_cycles_are_still_freed():
    with no_gc():
        kept = [[i] for i in range(100)]  # (lists: a dict of atoms is not tracked)
        cycle = Node()
        cycle.me = cycle
        gone = weakref.ref(cycle)
    assert gc.isenabled()
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(kept) in oldest and all(id(x) in oldest for x in kept)
    del cycle
    gc.collect()
    assert gone() is None


def test_nested_blocks_leave_the_collector_off_until_the_outer_ends():
    with no_gc():
        with no_gc():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
