"""The parallel dimensions as one value (toolkit.plan.parallel_dims): the label every command
prints, the short form --layouts reads, the world they multiply into, and the composition that
selects them, all from one list of dimensions."""

from __future__ import annotations

import pytest

from toolkit.plan.layout import resolve
from toolkit.plan.parallel_dims import DIMS, ParallelDims, parse_degrees


def test_one_list_of_dimensions_drives_the_label_the_short_form_and_the_overrides():
    dims = ParallelDims(tp=2, pp=2, vpp=2, dp=3)
    assert [d.name for d in DIMS] == ["tp", "pp", "vpp", "cp", "dp"]
    assert dims.label() == "tp=2 pp=2 vpp=2 cp=1 dp=3"
    assert dims.short() == "tp2_pp2_vpp2_dp3" and ParallelDims().short() == "dp1"
    assert ParallelDims.parse(dims.short()) == dims  # the short form round-trips
    assert dims.overrides(derived=("dp",)) == ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.cp=1"]
    # vpp chunks a stage's layers: 2 x 2 x 3 ranks, not 2 x 2 x 2 x 3; dp replicates the model
    assert dims.world_size == 12 and dims.model_parallel_size == 4 and dims.model_splits == 3


def test_a_layout_carries_the_dims_its_configuration_resolves_to(compose):
    layout = resolve(compose("parallel=tp2_pp2_vpp2"))
    assert layout.dims == ParallelDims(tp=2, pp=2, vpp=2, cp=1, dp=1)
    assert (layout.tp, layout.pp, layout.vpp, layout.cp, layout.dp) == (2, 2, 2, 1, 1)
    assert layout.dims.world_size == layout.world_size


@pytest.mark.parametrize(
    "text, said",
    [
        ("tp2_xx4", "'xx4' is not a size"),
        ("tp2_tp4", "gives tp twice"),
        ("dp0", "'dp0' is not a size"),
        ("tp", "not a size"),
    ],
)
def test_a_short_form_that_does_not_parse_names_its_part(text, said):
    with pytest.raises(ValueError, match=said):
        parse_degrees(text)
