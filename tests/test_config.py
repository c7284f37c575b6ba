"""Composition through Hydra's typed schema, the published architectures, and the layout math."""

import dataclasses
import enum
import math
import typing
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from toolkit.config.schema import Config
from toolkit.config.store import UnknownOptionError, conf_dir, quote_numeric_choices
from toolkit.plan.layout import bubble_fraction, lr_scale_factor, padded_vocab_size, rescaled_warmup, resolve

HF_CONFIG = Path(__file__).parent / "data" / "hf_qwen2"  # a config.json only


@pytest.mark.parametrize(
    "group", ["model", "parallel", "zero", "precision", "recompute", "optim", "train", "cluster", "backend", "data"]
)
def test_every_group_option_composes(compose, group):
    options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
    assert options
    for option in options:
        # model=hf reads its architecture from a Hugging Face directory's config.json
        compose(f"{group}={option}", *([f"model.hf_path={HF_CONFIG}"] if option == "hf" else []))


def test_cluster_presets_cover_cpu_single_h200_node_and_clusters():
    names = {p.stem for p in (conf_dir() / "cluster").glob("*.yaml")}
    assert {"cpu", "1xh200", "8xh100", "h100_cluster"} <= names


@pytest.mark.parametrize(
    "override,error",
    [
        ("parallel.tp=abc", ConfigCompositionException),
        ("parallel.unknown=1", ConfigCompositionException),
        ("train.global_batch=1.5", ConfigCompositionException),
        ("model=nope", MissingConfigException),
    ],
)
def test_wrong_type_or_unknown_key_fails_at_composition(compose, override, error):
    with pytest.raises(error):
        compose(override)


@pytest.mark.parametrize(
    "override,suggestion",
    [
        (
            "cluster.slurm.partiton=debug",
            "cluster.slurm has no field 'partiton'. Did you mean cluster.slurm.partition?",
        ),
        ("traim.steps=3", "the config has no field 'traim'. Did you mean train?"),
        ("model.num_layrs=2,4", "model has no field 'num_layrs'. Did you mean model.num_layers?"),
        ("+train.stpes=3", "train has no field 'stpes'. Did you mean train.steps?"),  # else silently dropped
        ("cluster.slurm.extra_sbatch.mail=END", "cluster.slurm.extra_sbatch is a list: set it whole"),  # else int()
    ],
)
def test_a_misspelled_key_names_the_closest_field(compose, override, suggestion):
    with pytest.raises(UnknownOptionError) as raised:
        compose(override)
    assert suggestion in str(raised.value)


def test_right_keys_and_hydra_keys_pass_the_field_check(compose):
    cfg = compose("cluster.slurm.partition=debug", "++train.steps=3", "hydra.job.chdir=false")
    assert cfg.cluster.slurm.partition == "debug" and cfg.train.steps == 3


def _enum_fields(section=Config, prefix=""):
    """(path, enum type, is a list) of every closed-choice field of the schema, nested sections included."""
    for f in dataclasses.fields(section):
        kind = typing.get_type_hints(section)[f.name]
        inner = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
        if dataclasses.is_dataclass(kind):
            yield from _enum_fields(kind, f"{prefix}{f.name}.")
        elif isinstance(inner, type) and issubclass(inner, enum.Enum):
            yield f"{prefix}{f.name}", inner, inner is not kind


ENUM_FIELDS = list(_enum_fields())


def test_closed_choices_are_enums():
    assert {
        "model.family",
        "model.normalization",
        "model.activation",
        "model.position_embedding",
        "zero.offload_optimizer",
        "zero.offload_param",
        "precision.dtype",
        "precision.loss_scaling",
        "precision.fp8_format",
        "recompute.granularity",
        "recompute.method",
        "recompute.modules",
        "optim.name",
        "optim.decay_style",
        "optim.lr_scaling",
        "train.attention_backend",
        "train.fault.nan_action",
        "cluster.device",
        "cluster.default_dtype",
        "backend.name",
        "data.name",
        "data.tokenizer",
    } <= {path for path, _, _ in ENUM_FIELDS}


@pytest.mark.parametrize("path,choices,is_list", ENUM_FIELDS, ids=[path for path, _, _ in ENUM_FIELDS])
def test_enum_field_refuses_other_values_at_composition(compose, path, choices, is_list):
    with pytest.raises(ConfigCompositionException) as raised:
        compose(f"{path}=[bogus]" if is_list else f"{path}=bogus")
    text = f"{raised.value} {raised.value.__cause__}"
    assert path in text and "bogus" in text
    assert all(choice.value in text for choice in choices), text
    for choice in choices:  # every allowed value composes, equal to its string
        value = compose(f"{path}=[{choice.value}]" if is_list else f"{path}={choice.value}")
        for part in path.split("."):
            value = getattr(value, part)
        assert value == ([choice.value] if is_list else choice.value) and f"{choice}" == choice.value


@pytest.mark.parametrize(
    "overrides,dtype",
    [
        (["cluster=h100_cluster"], "bf16"),
        (["cluster=8xh100"], "bf16"),
        (["cluster=1xh200"], "bf16"),
        (["cluster=a100_cluster"], "bf16"),
        ([], "fp32"),  # the default cluster: this machine's CPU
        (["cluster=cpu"], "fp32"),
        (["cluster=v100_cluster"], "fp32"),  # Volta has no bf16
        (["cluster=h100_cluster", "precision=fp16"], "fp16"),  # a precision given wins
        (["cluster=h100_cluster", "precision.dtype=fp32"], "fp32"),
        (["cluster=cpu", "precision=bf16"], "bf16"),
        (["recipe=tiny_cpu_demo", "cluster=h100_cluster"], "fp32"),  # so does a recipe's
        (["recipe=llama3_8b_8xh100", "cluster=cpu"], "bf16"),
    ],
)
def test_precision_follows_the_cluster_unless_given(compose, overrides, dtype):
    assert compose(*overrides).precision.dtype == dtype


def test_written_config_holds_the_concrete_precision(compose, tmp_path):
    from toolkit.config.store import load_run_config
    from toolkit.emit.files import resolved_config, write_run_files
    from toolkit.plan.layout import resolve

    cfg = compose("cluster=8xh100", "recompute=selective")
    write_run_files(cfg, resolve(cfg), tmp_path)
    text = (tmp_path / "config.yaml").read_text()
    assert "  dtype: bf16\n" in text and "${" not in text
    assert load_run_config(tmp_path) == resolved_config(cfg, resolve(cfg))  # the enums read back


def test_default_data_is_the_corpus_synthetic_on_request(compose):
    assert compose().data.name == "corpus" and compose().data.tokenizer == "gpt2"
    assert compose("data=synthetic").data.name == "synthetic"


def test_numeric_group_choices_are_quoted():
    assert quote_numeric_choices(["zero=3", "zero=0,1,2", "parallel.tp=2", "+zero=1"]) == [
        "zero='3'",
        "zero='0','1','2'",
        "parallel.tp=2",
        "+zero='1'",
    ]


def test_user_facing_names(compose):
    cfg = compose(
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.vpp=2",
        "zero=3",
        "precision=bf16",
        "recompute=full",
        "backend=deepspeed",
        "cluster.nodes=2",
        "cluster.gpus_per_node=8",
        "train.global_batch=64",
        "train.micro_batch=4",
        "train.steps=7",
    )
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.zero.stage) == (2, 2, 2, 3)
    assert (cfg.precision.dtype, cfg.recompute.granularity, cfg.backend.name) == ("bf16", "full", "deepspeed")
    assert (
        cfg.cluster.nodes,
        cfg.cluster.gpus_per_node,
        cfg.train.global_batch,
        cfg.train.micro_batch,
        cfg.train.steps,
    ) == (2, 8, 64, 4, 7)


def _param_count(m) -> int:
    """Total parameters from the architecture fields (tied embeddings counted once)."""
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    kv = m.num_kv_heads or m.num_attention_heads
    h, q, k = m.hidden_size, m.num_attention_heads * head_dim, kv * head_dim
    attn = h * q + 2 * h * k + q * h + (q + 2 * k if m.add_qkv_bias else 0) + (h if m.add_bias_linear else 0)
    mlp_in = m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1)
    mlp = h * mlp_in + m.ffn_hidden_size * h + ((mlp_in + h) if m.add_bias_linear else 0)
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    embed = m.vocab_size * h * (1 if m.tie_embeddings else 2)
    positions = m.max_position_embeddings * h if m.position_embedding == "learned_absolute" else 0
    return m.num_layers * (attn + mlp + 2 * norm) + norm + embed + positions


@pytest.mark.parametrize(
    "model,published",
    [
        ("gpt2_124m", 124_439_808),  # Hugging Face gpt2: sum of parameter sizes
        ("llama3_1b", 1_235_814_400),  # meta-llama/Llama-3.2-1B
        ("llama3_8b", 8_030_261_248),  # meta-llama/Llama-3.1-8B
        ("llama3_70b", 70_553_706_496),  # meta-llama/Llama-3.1-70B
        ("llama3_405b", 405_853_388_800),  # meta-llama/Llama-3.1-405B
        ("qwen2_0_5b", 494_032_768),  # Qwen/Qwen2.5-0.5B
        ("mistral_7b", 7_241_732_096),  # mistralai/Mistral-7B-v0.1
    ],
)
def test_published_architectures_have_their_parameter_counts(compose, model, published):
    assert _param_count(compose(f"model={model}").model) == published


def test_gpt3_is_175b(compose):
    assert _param_count(compose("model=gpt3_175b").model) == pytest.approx(
        175.0e9, rel=0.005
    )  # Brown et al. 2020, Table 2.1


def test_vocab_padding_is_the_models_at_every_tp(compose):
    """Rounded to make_vocab_size_divisible_by alone (Megatron-LM rounds to it x tp: 50,432 rows
    at tp=2 against 50,304 at tp=1, another model); the layout and the emitted command carry it."""
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(128256, 128) == 128256
    assert padded_vocab_size(50258, 0) == 50258
    for tp in (1, 2, 4, 8):
        cfg = compose("model=gpt2_124m", "cluster=8xh100", f"parallel.tp={tp}")
        assert resolve(cfg).padded_vocab_size == 50304


def test_lr_and_warmup_rescaling_rules():
    assert lr_scale_factor("linear", 1024, 256) == 4.0
    assert lr_scale_factor("sqrt", 1024, 256) == 2.0
    assert lr_scale_factor("none", 1024, 256) == 1.0
    assert rescaled_warmup(2000, "sqrt", 1024, 256) == 500  # same number of warmup samples
    assert rescaled_warmup(2000, "none", 1024, 256) == 2000


def test_resolve_derives_dp_accumulation_steps_and_lr(compose):
    layout = resolve(
        compose(
            "cluster=h100_cluster",
            "parallel.tp=8",
            "parallel.pp=2",
            "train.global_batch=256",
            "train.micro_batch=2",
            "train.steps=null",
            "train.tokens=1000000",
            "model.seq_length=128",
            "optim.lr=1e-3",
            "optim.reference_global_batch=64",
            "optim.lr_scaling=sqrt",
            "optim.warmup_steps=100",
        )
    )
    assert (layout.world_size, layout.dp, layout.grad_accum) == (64, 4, 32)
    assert layout.steps == math.ceil(1_000_000 / (256 * 128))
    assert layout.lr == pytest.approx(2e-3) and layout.warmup_steps == 25
    assert layout.bubble_fraction == pytest.approx(bubble_fraction(2, 1, 32)) == pytest.approx(1 / 32)
