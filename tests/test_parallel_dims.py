"""The parallel dimensions as one value (toolkit.plan.parallel_dims): the label every command
prints, the short form --layouts reads, the world they multiply into, and the composition that
selects them, all from one list of dimensions."""

from __future__ import annotations

import pytest

from toolkit.plan.layout import resolve
from toolkit.plan.parallel_dims import DIMS, ParallelDims, parse_degrees


def test_one_list_of_dimensions_drives_the_label_the_short_form_and_the_overrides():
    dims = ParallelDims(tp=2, pp=2, vpp=2, dp=3)
    assert [d.name for d in DIMS] == ["tp", "pp", "vpp", "cp", "dp", "ep", "etp"]
    assert dims.label() == "tp=2 pp=2 vpp=2 cp=1 dp=3"
    assert dims.short() == "tp2_pp2_vpp2_dp3" and ParallelDims().short() == "dp1"
    assert ParallelDims.parse(dims.short()) == dims  # the short form round-trips
    assert dims.replace(vpp=1) == ParallelDims(tp=2, pp=2, dp=3) and dims.vpp == 2
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


@pytest.fixture
def dummy_dimension():
    """A dimension parakit does not have, added the way a new one is: an entry in the registry of
    dimensions and a field in the schema's parallel section (with its bounds). It adds no ranks
    (as vpp) and has no physics, so memory and step time must not see it."""
    import dataclasses

    from toolkit.config.schema import ParallelConfig, at_least_one
    from toolkit.plan.parallel_dims import Dim

    dummy = Dim("xp", "a dimension only this test has", multiplies_world=False)
    section = dataclasses.make_dataclass("WithXp", [("xp", int, at_least_one(1))], bases=(ParallelConfig,))

    def with_xp(cfg, xp: int):
        degrees = {f.name: getattr(cfg.parallel, f.name) for f in dataclasses.fields(ParallelConfig)}
        return dataclasses.replace(cfg, parallel=section(**degrees, xp=xp))

    DIMS.append(dummy)
    try:
        yield with_xp
    finally:
        DIMS.remove(dummy)


def test_a_new_dimension_needs_only_its_entry_and_its_schema_field(compose, dummy_dimension, monkeypatch):
    """With the registry entry and the schema field alone (the fixture), the new dimension is
    resolved, labelled, parsed back, put into overrides, range-checked, refused until a backend's
    description says it trains with it, swept (sweep.csv's columns and a point's row), tabled by
    `plan` and the report page; the planner's figures ignore it (it has no physics)."""
    import dataclasses

    from toolkit.plan import backends
    from toolkit.plan.memory import peak_memory
    from toolkit.plan.perf import estimate_step
    from toolkit.plan.report import _columns
    from toolkit.plan.search import candidate_configs
    from toolkit.plan.validate import validate
    from toolkit.report.load import layout_keys
    from toolkit.report.page import table
    from toolkit.report.sweep import _layout_fields, columns

    plain = compose("parallel=tp2_pp2_vpp2")
    cfg, one = dummy_dimension(plain, 3), dummy_dimension(plain, 1)
    layout = resolve(cfg)
    assert layout.dims.xp == 3 and layout.dims.label() == "tp=2 pp=2 vpp=2 cp=1 dp=1 xp=3"
    assert ParallelDims.parse(layout.dims.short()) == layout.dims and layout.dims.short() == "tp2_pp2_vpp2_xp3"
    assert "parallel.xp=3" in layout.dims.overrides(derived=("dp",))
    assert layout.world_size == resolve(one).world_size  # no ranks of its own
    # which backends train with a dimension is their description's: none does yet
    (unsupported,) = validate(cfg).errors
    assert unsupported.rule == "megatron_layout" and unsupported.fix == "set parallel.xp=1: no backend trains with it"
    megatron = backends.BACKENDS["megatron"]
    monkeypatch.setitem(
        backends.BACKENDS, "megatron", dataclasses.replace(megatron, parallel_dims=megatron.parallel_dims | {"xp"})
    )
    assert validate(cfg).ok
    refused = [v for v in validate(dummy_dimension(plain, 0)).errors if v.rule == "range"]
    assert [list(v.fields) for v in refused] == [["parallel.xp"]]
    assert "xp" in columns() and _layout_fields(cfg, layout)["xp"] == 3 and "xp" in layout_keys()
    assert "xp" in _columns() and "xp" in [header for header, _ in table()]
    # the layout search keeps a dimension without candidate degrees (search.DEGREE_OPTIONS) at 1
    assert {c.parallel.xp for c in candidate_configs(cfg)} == {1}
    assert estimate_step(cfg, layout) == estimate_step(one, resolve(one))
    assert peak_memory(cfg, layout) == peak_memory(one, resolve(one))


def test_the_expert_dimensions_fold_into_the_ranks_and_are_quiet_at_their_default():
    """ep and etp add no ranks (megatron-core's MoE folding: etp x ep x edp = tp x cp x dp); etp
    left unset follows tp; a dense layout's label, short form and overrides do not mention them."""
    dense = ParallelDims(tp=2, dp=4)
    assert dense.etp == 2 and dense.ep == 1 and dense.label() == "tp=2 pp=1 vpp=1 cp=1 dp=4"
    assert dense.short() == "tp2_dp4" and dense.model_splits == 1  # etp = tp is not a second split
    moe = ParallelDims(tp=2, dp=4, ep=4)
    assert moe.world_size == 8 and moe.edp == 1 and moe.label() == "tp=2 pp=1 vpp=1 cp=1 dp=4 ep=4"
    assert moe.stride("ep") == 2 and moe.stride("edp") == 8  # experts numbered etp, ep, edp
    assert moe.overrides(derived=("dp",)) == [
        "parallel.tp=2",
        "parallel.pp=1",
        "parallel.vpp=1",
        "parallel.cp=1",
        "parallel.ep=4",
    ]
    narrow = moe.replace(etp=1)
    assert narrow.edp == 2 and narrow.short() == "tp2_dp4_ep4_etp1" and ParallelDims.parse(narrow.short()) == narrow
    assert narrow.label().endswith("ep=4 etp=1") and narrow.model_splits == 2


def test_the_rank_order_gives_each_groups_stride():
    """megatron-core's default order, tp innermost, then cp, dp and pp."""
    dims = ParallelDims(tp=2, pp=4, cp=2, dp=3)
    assert [dims.stride(n) for n in ("tp", "cp", "dp", "pp")] == [1, 2, 4, 12]
