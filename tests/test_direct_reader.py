"""DirectFileSystemReader (toolkit.train.direct_reader) loads a torch.distributed.checkpoint exactly as
DCP's own reader does: whole contiguous records straight into their destinations, anything else
(a strided destination, a record of another dtype, non-tensor objects) DCP's way. Megatron-core's
resumes through it are covered by the exact-resume and reshard tests."""

import io
import types
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from toolkit.train import direct_reader
from toolkit.train.direct_reader import DirectFileSystemReader


@pytest.fixture
def saved(tmp_path):
    gen = torch.Generator().manual_seed(0)
    state = {
        "fp32": torch.randn(64, 32, generator=gen),
        "bf16": torch.randn(16, 8, generator=gen).to(torch.bfloat16),
        "ints": torch.arange(40, dtype=torch.int64),
        "strided": torch.randn(16, 8, generator=gen),
        "other_dtype": torch.randn(8, generator=gen),
        "object": {"step": 7},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    return tmp_path, state


def load(path, reader_class):
    targets = {
        "fp32": torch.zeros(64, 32),
        "bf16": torch.zeros(16, 8, dtype=torch.bfloat16),
        "ints": torch.zeros(40, dtype=torch.int64),
        "strided": torch.zeros(16, 16)[:, :8],  # a non-contiguous destination
        "other_dtype": torch.zeros(8, dtype=torch.float64),  # DCP casts while copying
        "object": {"step": 0},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=reader_class(path), no_dist=True)
    return targets


def test_it_loads_what_dcps_reader_loads_reading_whole_records_directly(saved, monkeypatch):
    path, state = saved
    expected = load(path, dcp.FileSystemReader)
    full_loads = []
    real_load = torch.load

    def counting(*args, **kwargs):
        if kwargs.get("map_location") != "meta" and not isinstance(args[0], io.BytesIO):  # not the object
            full_loads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    got = load(path, DirectFileSystemReader)
    for key in ("fp32", "bf16", "ints", "strided", "other_dtype"):
        assert torch.equal(got[key], expected[key]), key
        assert torch.equal(got[key].to(state[key].dtype), state[key]), key
    assert got["object"] == {"step": 7}
    # the strided and the other-dtype destinations took DCP's way (a torch.load of the record each)
    assert len(full_loads) == 2, full_loads


def test_whole_rows_of_a_record_are_read_from_their_own_offset(saved):
    """What another data-parallel size loads of a flat optimizer shard: rows 2-4 of a 64 x 32
    record, read straight from the file; a slice across the rows takes DCP's way."""
    path, state = saved
    reader = DirectFileSystemReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    (index,) = [i for i in reader.storage_data if i.fqn == "fp32"]
    info = reader.storage_data[index]
    rows = types.SimpleNamespace(storage_offsets=(2, 0), lengths=(3, 32))
    columns = types.SimpleNamespace(storage_offsets=(0, 4), lengths=(64, 8))
    with open(path / info.relative_path, "rb") as file:
        offset = reader._direct_offset(file, info, rows, torch.empty(3, 32))
        file.seek(info.offset + offset)
        got = torch.frombuffer(bytearray(file.read(3 * 32 * 4)), dtype=torch.float32).reshape(3, 32)
        assert torch.equal(got, state["fp32"][2:5])
        assert reader._direct_offset(file, info, columns, torch.empty(64, 8)) is None
        assert reader._direct_offset(file, info, rows, torch.empty(3, 32, dtype=torch.float64)) is None


def test_a_record_cut_short_is_an_error_not_a_partial_tensor(saved):
    path, _ = saved
    (data,) = [f for f in path.iterdir() if f.suffix == ".distcp"]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(dcp.api.CheckpointException, match="EOFError|ends inside"):
        load(path, DirectFileSystemReader)


def test_megatron_core_loads_through_it_inside_direct_reads():
    from toolkit.compat import import_shims

    import_shims()
    from megatron.core.dist_checkpointing.strategies import torch as strategies
    from megatron.core.transformer import mlp

    built, merge = strategies._get_filesystem_reader, mlp.cat_with_oom_fallback
    with direct_reader.direct_reads():
        assert isinstance(strategies._get_filesystem_reader("somewhere"), DirectFileSystemReader)
        assert mlp.cat_with_oom_fallback is not merge
    assert strategies._get_filesystem_reader is built
    assert mlp.cat_with_oom_fallback is merge


def test_halves_read_into_one_tensor_merge_into_that_tensor_without_a_copy():
    weight = torch.arange(24.0).reshape(6, 4)
    halves = list(torch.chunk(weight, 2))
    merged = direct_reader.merge_adjacent(halves, concatenate=pytest.fail)
    assert merged.data_ptr() == weight.data_ptr() and torch.equal(merged, weight)
    # three pieces, and pieces of a flat tensor
    flat = torch.arange(12.0)
    merged = direct_reader.merge_adjacent(list(flat.split([2, 3, 7])), concatenate=pytest.fail)
    assert merged.data_ptr() == flat.data_ptr()


@pytest.mark.parametrize(
    "pieces",
    [
        lambda w: [w[3:], w[:3]],  # out of order
        lambda w: [w[:2], w[3:]],  # a row between them
        lambda w: [w[:3], w[3:].clone()],  # another tensor
        lambda w: [w[:3, :2], w[3:, :2]],  # not contiguous
        lambda w: [w[:3], w[3:].double()],  # another dtype
    ],
    ids=["reversed", "gap", "other_tensor", "strided", "dtype"],
)
def test_pieces_that_are_not_one_tensor_end_to_end_are_concatenated(pieces):
    weight = torch.arange(24.0).reshape(6, 4)
    parts = pieces(weight)
    merged = direct_reader.merge_adjacent(parts, concatenate=lambda p: torch.cat([t.double() for t in p]))
    assert torch.equal(merged, torch.cat([t.double() for t in parts]))
    assert merged.data_ptr() != weight.data_ptr()


def test_megatron_cores_swiglu_factory_merges_into_the_tensor_it_was_built_from():
    """megatron-core's own factory (mlp.apply_swiglu_sharded_factory): built inside direct_reads,
    its merge of the two halves it made hands back the weight itself."""
    from toolkit.compat import import_shims

    import_shims()
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer import mlp

    weight = torch.randn(8, 4)
    with direct_reader.direct_reads():
        factory = mlp.apply_swiglu_sharded_factory(ShardedTensor.from_rank_offsets("fc1", weight), ())
    halves = [piece.data for piece in factory.build()]
    assert halves[0].data_ptr() == weight.data_ptr()
    merged = factory.merge_fn(halves)
    assert merged.data_ptr() == weight.data_ptr() and torch.equal(merged, weight)


def test_a_checkpoint_of_several_files_loads_whole_with_the_files_read_at_once(tmp_path):
    gen = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(256, 64, generator=gen) for i in range(6)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=3), no_dist=True)
        assert len(list(tmp_path.glob("*.distcp"))) == 3
        targets = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
        dcp.load(targets, storage_reader=DirectFileSystemReader(tmp_path), no_dist=True)
    assert all(torch.equal(targets[name], state[name]) for name in state)
