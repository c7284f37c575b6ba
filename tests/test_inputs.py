"""Files a command reads, drawn at random: a Hugging Face config.json of any shape and types is a
model or a clear HfConfigError naming model.hf_path, never another exception."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolkit.families.hf_config import model_fields
from toolkit.formats.hf_arch import HfConfigError

# A llama config.json whose keys a user's file could give any JSON value.
GOOD = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(sorted(GOOD)), JSON_VALUES, min_size=1, max_size=3), drop=st.booleans())
def test_any_config_json_is_a_model_or_a_clear_error(tmp_path, changes, drop):
    config = {k: v for k, v in GOOD.items() if not (drop and k in changes)} if drop else {**GOOD, **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    try:
        fields = model_fields(tmp_path)
    except HfConfigError as e:
        assert "model.hf_path" in str(e)
        return
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
        assert isinstance(fields[name], int) and not isinstance(fields[name], bool), (name, fields[name])


def test_a_config_json_that_is_not_an_object_is_named(tmp_path):
    for text in ("[1, 2]", '"llama"', "3"):
        (tmp_path / "config.json").write_text(text)
        try:
            model_fields(tmp_path)
        except HfConfigError as e:
            assert "config.json holds a JSON" in str(e)
        else:
            raise AssertionError(text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_plan_names_any_field_out_of_its_bounds_and_never_raises(compose, capsys, data):
    """`parakit plan`'s whole path (the search, the configured layout's estimate, the text and the
    JSON) on a configuration with one field drawn past one of its bounds: the field named with its
    fix, never an exception; exit 2 unless the search chooses that field itself (parallel.tp=0
    configured, the search still ranks its own tp)."""
    from test_rules import BAD, with_value

    from toolkit.plan.report import plan_command
    from toolkit.plan.search import SEARCHED

    path, bounds, value = data.draw(st.sampled_from(BAD))
    cfg = with_value(compose("checks.memory=off"), path, value)
    codes = plan_command(cfg), plan_command(cfg, as_json=True)
    assert path.startswith(SEARCHED) or codes == (2, 2), (path, value, codes)
    out = capsys.readouterr().out
    assert f"{path}=" in out and bounds.fix.format(path=path) in out, (path, value, out[-2000:])
