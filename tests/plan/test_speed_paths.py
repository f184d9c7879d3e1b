"""The search's shortcuts give what the long way gives: a symbolic rank's process groups built alone (so a
16,384-GPU mesh costs what one rank needs) are those of the whole world's that hold it, in the same order."""
import pytest

from syntorch.parallel.mesh import Mesh

MESHES = [Mesh(dp=2, pp=2, tp=2), Mesh(dp=3, pp=4, tp=2, cp=2, ring=True), Mesh(dp=4, pp=2, tp=2, ep=2),
          Mesh(dp=2, tp=2, cp=2, pp=2, etp=1, ep=8), Mesh(dp=4, tp=2, cp=2, pp=3, ep=4), Mesh(dp=8)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("tied", (False, True))
def test_one_ranks_groups_are_the_worlds_that_hold_it(mesh, tied):
    every = mesh.process_groups(tied)
    for rank in range(mesh.world_size):
        assert mesh.process_groups(tied, rank) == [(kind, g) for kind, g in every if rank in g]
