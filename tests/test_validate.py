"""Each validator rule: a case it rejects (naming the field and a fix) and a neighbouring case it
accepts. The base configuration is conf/config.yaml's default (tiny model, 4 CPU ranks)."""

import dataclasses

import pytest

from toolkit.plan.validate import ValidationError, check, validate

H100 = "cluster=8xh100"
DS = "backend=deepspeed"
# llama3 RoPE scaling on the tiny model, with a context longer than Llama 3.1's pretraining 8192
LLAMA3 = ["model.rope_scaling.type=llama3", "model.max_position_embeddings=16384"]

# rule, overrides it rejects, neighbouring overrides it accepts, a field the message must name
ERROR_CASES = [
    ("world_size", ["parallel.dp=3"], ["parallel.dp=4"], "parallel.dp"),
    (
        "world_size",
        ["cluster.gpus_per_node=3", "parallel.tp=2"],
        ["cluster.gpus_per_node=4", "parallel.tp=2"],
        "parallel.tp",
    ),
    (
        "tp_heads",
        ["model.num_attention_heads=6", "model.num_kv_heads=6", "model.hidden_size=96", "parallel.tp=4"],
        ["model.num_attention_heads=6", "model.num_kv_heads=6", "model.hidden_size=96", "parallel.tp=2"],
        "model.num_attention_heads",
    ),
    (
        "tp_heads",
        ["model.num_attention_heads=12", "model.num_kv_heads=3", "model.hidden_size=96", "parallel.tp=4"],
        ["model.num_attention_heads=12", "model.num_kv_heads=4", "model.hidden_size=96", "parallel.tp=4"],
        "model.num_kv_heads",
    ),
    (
        "tp_ffn",
        ["model.ffn_hidden_size=190", "parallel.tp=4"],
        ["model.ffn_hidden_size=192", "parallel.tp=4"],
        "model.ffn_hidden_size",
    ),
    (
        "vocab_tp",
        ["model.make_vocab_size_divisible_by=0", "parallel.tp=2"],
        ["model.make_vocab_size_divisible_by=128", "parallel.tp=2"],
        "model.vocab_size",
    ),
    (
        "tp_in_node",
        ["cluster.nodes=2", "cluster.gpus_per_node=2", "parallel.tp=4"],
        ["cluster.nodes=2", "cluster.gpus_per_node=2", "parallel.tp=2"],
        "cluster.gpus_per_node",
    ),
    (
        "sp_needs_tp",
        [H100, "parallel.sequence_parallel=true"],
        [H100, "parallel.sequence_parallel=true", "parallel.tp=2"],
        "parallel.sequence_parallel",
    ),
    (
        "sp_seq",
        [H100, "parallel.sequence_parallel=true", "parallel.tp=4", "model.seq_length=126"],
        [H100, "parallel.sequence_parallel=true", "parallel.tp=4", "model.seq_length=128"],
        "model.seq_length",
    ),
    (
        "cp_seq",
        [H100, "parallel.cp=2", "model.seq_length=126"],
        [H100, "parallel.cp=2", "model.seq_length=128"],
        "parallel.cp",
    ),
    ("pp_layers", ["parallel.pp=4", "model.num_layers=6"], ["parallel.pp=4", "model.num_layers=8"], "model.num_layers"),
    (
        "pp_layers",
        ["parallel.pp=2", "parallel.vpp=4", "model.num_layers=12"],
        ["parallel.pp=2", "parallel.vpp=3", "model.num_layers=12"],
        "parallel.vpp",
    ),
    (
        "pp_uneven",
        ["parallel.pp=4", "model.num_layers=10", "parallel.first_stage_layers=1", "parallel.last_stage_layers=2"],
        ["parallel.pp=4", "model.num_layers=10", "parallel.first_stage_layers=1", "parallel.last_stage_layers=1"],
        "parallel.first_stage_layers",
    ),
    ("pp_uneven", ["parallel.first_stage_layers=2"], ["parallel.first_stage_layers=2", "parallel.pp=2"], "parallel.pp"),
    ("vpp_needs_pp", ["parallel.vpp=2"], ["parallel.vpp=2", "parallel.pp=2"], "parallel.vpp"),
    (
        "vpp_microbatches",
        ["parallel.pp=4", "parallel.vpp=2", "train.global_batch=12"],
        ["parallel.pp=4", "parallel.vpp=2", "train.global_batch=16"],
        "train.global_batch",
    ),
    ("batch_split", ["train.global_batch=15"], ["train.global_batch=16"], "train.micro_batch"),
    ("grad_accum", ["train.grad_accum=3"], ["train.grad_accum=2"], "train.grad_accum"),
    ("zero_pipeline", [DS, "zero=2", "parallel.pp=2"], [DS, "zero=1", "parallel.pp=2"], "zero.stage"),
    ("deepspeed_layout", [DS, "parallel.tp=2"], ["backend=megatron", "parallel.tp=2"], "parallel.tp"),
    (
        "deepspeed_layout",
        [DS, H100, "parallel.tp_comm_overlap=true"],
        ["backend=megatron", H100, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"],
        "parallel.tp_comm_overlap",
    ),
    (
        "tp_overlap_needs_sp",
        [H100, "parallel.tp=2", "parallel.tp_comm_overlap=true"],
        [H100, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"],
        "parallel.sequence_parallel",
    ),
    (
        "tp_overlap_device",
        ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"],
        ["parallel.tp=2", "parallel.sequence_parallel=true"],
        "cluster.device",
    ),
    (
        "pipeline_sliding_window",
        [DS, "parallel.pp=2", "model.sliding_window=64"],
        [DS, "model.sliding_window=64"],
        "model.sliding_window",
    ),
    (
        "pipeline_tied_embeddings",
        [DS, "parallel.pp=2", "model.tie_embeddings=true"],
        [DS, "parallel.pp=2"],
        "model.tie_embeddings",
    ),
    ("fp8_backend", [DS, "precision=fp8", H100], ["backend=megatron", "precision=fp8", H100], "precision.dtype"),
    (
        "nan_action_backend",
        [DS, "zero=0", "precision=fp32", "train.fault.nan_action=skip"],
        [DS, "zero=1", "precision=fp32", "train.fault.nan_action=skip"],
        "train.fault.nan_action",
    ),
    (
        "checkpoint_interval",
        ["checkpoint.auto_interval=true", "checkpoint.interval_steps=100"],
        ["checkpoint.auto_interval=true"],
        "checkpoint.interval_steps",
    ),
    (
        "profile_steps",
        ["train.profile_step_start=4", "train.profile_step_end=4"],
        ["train.profile_step_start=4", "train.profile_step_end=5"],
        "train.profile_step_end",
    ),
    ("profile_steps", ["train.profile_step_end=5"], ["train.profile_step_start=3"], "train.profile_step_start"),
    ("range", ["checkpoint.interval_minutes=0"], ["checkpoint.interval_minutes=30"], "checkpoint.interval_minutes"),
    ("async_save_backend", [DS, "checkpoint.async_save=true"], ["checkpoint.async_save=true"], "checkpoint.async_save"),
    ("recompute_backend", [DS, "recompute=selective"], [DS, "recompute=full"], "recompute.granularity"),
    (
        "init_weights_backend",
        [DS, "train.save_init_checkpoint=/tmp/init"],
        ["train.save_init_checkpoint=/tmp/init"],
        "train.save_init_checkpoint",
    ),
    ("zero_megatron", ["zero=2"], ["zero=2", DS], "zero.stage"),
    ("offload_backend", ["zero=2_offload"], ["zero=2_offload", DS], "zero.offload_optimizer"),
    (
        "offload_stage",
        [DS, "zero=0", "zero.offload_optimizer=cpu"],
        [DS, "zero=1", "zero.offload_optimizer=cpu"],
        "zero.stage",
    ),
    (
        "offload_stage",
        [DS, "zero=2", "zero.offload_param=cpu"],
        [DS, "zero=3", "zero.offload_param=cpu"],
        "zero.offload_param",
    ),
    (
        "offload_nvme",
        [DS, "zero=3", "zero.offload_param=nvme"],
        [DS, "zero=3", "zero.offload_param=nvme", "zero.nvme_path=/nvme"],
        "zero.nvme_path",
    ),
    (
        "fp16_loss_scale",
        [H100, "precision=fp16", "precision.loss_scaling=none"],
        [H100, "precision=fp16"],
        "precision.loss_scaling",
    ),
    ("fp16_cpu", ["precision=fp16"], ["precision=bf16"], "cluster.device"),
    (
        "dtype_hardware",
        ["cluster=v100_cluster", "cluster.nodes=1", "precision=bf16"],
        ["cluster=v100_cluster", "cluster.nodes=1", "precision=fp16"],
        "precision.dtype",
    ),
    (
        "dtype_hardware",
        ["cluster=a100_cluster", "cluster.nodes=1", "precision=fp8"],
        ["cluster=h100_cluster", "cluster.nodes=1", "precision=fp8"],
        "cluster.gpu",
    ),
    ("seq_length", ["model.seq_length=512"], ["model.seq_length=256"], "model.max_position_embeddings"),
    (
        "recompute_layers",
        ["recompute=full", "recompute.num_layers=3"],
        ["recompute=full", "recompute.num_layers=2"],
        "recompute.num_layers",
    ),
    (
        "recompute_layers",
        ["recompute=full", "recompute.method=block", "recompute.num_layers=9"],
        ["recompute=full", "recompute.method=block", "recompute.num_layers=8"],
        "recompute.method",
    ),
    ("min_lr", ["optim.min_lr=1e-2"], ["optim.min_lr=1e-5"], "optim.min_lr"),
    (
        "lr_reference",
        ["optim.lr_scaling=sqrt"],
        ["optim.lr_scaling=sqrt", "optim.reference_global_batch=8"],
        "optim.reference_global_batch",
    ),
    ("rope_scaling", [*LLAMA3, "model.rope_scaling.factor=0.5"], [*LLAMA3, "model.rope_scaling.factor=2"], "factor"),
    (
        "rope_scaling",
        [*LLAMA3, DS, "model.rope_scaling.high_freq_factor=1"],
        [*LLAMA3, DS, "model.rope_scaling.high_freq_factor=2"],
        "model.rope_scaling.high_freq_factor",
    ),
    (
        "rope_scaling_context",
        ["model.rope_scaling.type=llama3"],
        ["model.rope_scaling.type=llama3", "model.max_position_embeddings=8193"],
        "model.rope_scaling.original_max_position_embeddings",
    ),
    (
        "rope_scaling_position",
        [*LLAMA3, "model.position_embedding=learned_absolute"],
        [*LLAMA3, "model.position_embedding=rope"],
        "model.position_embedding",
    ),
    (
        "rope_scaling_backend",
        [*LLAMA3, "model.rope_scaling.low_freq_factor=2"],
        [*LLAMA3, "model.rope_scaling.low_freq_factor=2", DS],
        "model.rope_scaling.low_freq_factor",
    ),
    (
        "rope_scaling_backend",
        [*LLAMA3, "model.rope_scaling.original_max_position_embeddings=4096"],
        [*LLAMA3, "model.rope_scaling.original_max_position_embeddings=8192"],
        "model.rope_scaling.original_max_position_embeddings",
    ),
    ("rotary_base_integer", ["model.rotary_base=10000.5"], ["model.rotary_base=10000.5", DS], "model.rotary_base"),
    ("head_dim", ["model.hidden_size=66"], ["model.hidden_size=66", "model.head_dim=16"], "model.hidden_size"),
    ("kv_heads", ["model.num_kv_heads=3"], ["model.num_kv_heads=2"], "model.num_kv_heads"),
    ("range", ["parallel.tp=0"], ["parallel.tp=1"], "parallel.tp"),
    ("range", ["cluster.sm_count=0"], ["cluster.sm_count=108"], "cluster.sm_count"),
    ("range", ["optim.lr=-1"], ["optim.lr=1e-3"], "optim.lr"),
    ("finite", ["optim.lr=nan"], ["optim.lr=1e-3"], "optim.lr"),
    ("finite", ["optim.lr=inf"], ["optim.lr=1e-3"], "optim.lr"),
    ("finite", ["cluster.gpu_memory_gb=-inf"], ["cluster.gpu_memory_gb=8"], "cluster.gpu_memory_gb"),
    ("finite", ["train.fault.watchdog_timeout_s=inf"], ["train.fault.watchdog_timeout_s=600"], "watchdog_timeout_s"),
    ("vocab_tokenizer", ["model.vocab_size=32000"], ["model.vocab_size=32000", "data=synthetic"], "model.vocab_size"),
    ("vocab_tokenizer", ["model.vocab_size=50000"], ["model.vocab_size=50257"], "data.name"),
    ("vocab_tokenizer", ["model=mistral_7b", H100], ["model=mistral_7b", H100, "data=synthetic"], "data.name"),
    ("choice", ["zero.stage=4"], ["zero.stage=3", DS], "zero.stage"),
    ("train_length", ["train.steps=null"], ["train.steps=null", "train.tokens=100000"], "train.tokens"),
    ("train_length", ["train.tokens=100000"], ["train.steps=null", "train.tokens=100000"], "train.steps=null"),
]

WARNING_CASES = [
    (
        "profile_steps",
        ["train.steps=10", "train.profile_step_start=11"],
        ["train.steps=10", "train.profile_step_start=10"],
        "train.profile_step_start",
    ),
    ("bubble", ["parallel.pp=4", "train.global_batch=8"], ["parallel.pp=4", "train.global_batch=64"], "parallel.pp"),
    (
        "few_microbatches",
        ["parallel.pp=2", "train.global_batch=6", "train.micro_batch=1"],
        ["parallel.pp=2", "train.global_batch=16", "train.micro_batch=1"],
        "micro-batches",
    ),
    (
        "tp_spans_nodes",
        ["cluster.nodes=2", "cluster.gpus_per_node=6", "parallel.tp=4", "train.global_batch=12", "train.micro_batch=1"],
        ["cluster.nodes=2", "cluster.gpus_per_node=6", "parallel.tp=2", "train.global_batch=12", "train.micro_batch=1"],
        "parallel.tp",
    ),
    (
        "tp_power_of_two",
        [
            "model.num_attention_heads=6",
            "model.num_kv_heads=6",
            "model.hidden_size=96",
            "cluster.gpus_per_node=6",
            "parallel.tp=3",
            "train.global_batch=12",
            "train.micro_batch=1",
        ],
        [
            "model.num_attention_heads=6",
            "model.num_kv_heads=6",
            "model.hidden_size=96",
            "cluster.gpus_per_node=6",
            "parallel.tp=2",
            "train.global_batch=12",
            "train.micro_batch=1",
        ],
        "parallel.tp",
    ),
    (
        "lr_not_rescaled",
        ["optim.reference_global_batch=32"],
        ["optim.reference_global_batch=32", "optim.lr_scaling=sqrt"],
        "optim.lr_scaling",
    ),
    ("warmup", ["optim.warmup_steps=40"], ["optim.warmup_steps=10"], "optim.warmup_steps"),
]


def _case_id(case):
    return f"{case[0]}:{' '.join(case[1])}"


@pytest.fixture
def compose(compose):
    """The cases here leave the memory check out: many use big models on few GPUs to reach their
    rule (tests/test_fit.py tests the memory rule, with its own neighbours)."""
    return lambda *overrides: compose("checks.memory=off", *overrides)


@pytest.mark.parametrize("rule,bad,good,field", ERROR_CASES, ids=map(_case_id, ERROR_CASES))
def test_error_rule_rejects_with_field_and_fix(compose, rule, bad, good, field):
    report = validate(compose(*bad))
    hits = [v for v in report.errors if v.rule == rule]
    assert hits, f"{rule} not reported for {bad}: {report}"
    text = str(hits[0])
    assert field in text
    assert "Fix: " in text and len(text.split("Fix: ", 1)[1]) > 5
    with pytest.raises(ValidationError) as raised:
        check(compose(*bad))
    assert rule in str(raised.value)

    neighbour = validate(compose(*good))
    assert neighbour.ok, f"neighbour {good} rejected: {neighbour}"


@pytest.mark.parametrize("rule,bad,good,field", WARNING_CASES, ids=map(_case_id, WARNING_CASES))
def test_warning_rule_flags_slow_layout_with_fix(compose, rule, bad, good, field):
    report = validate(compose(*bad))
    assert report.ok, report  # valid, only slow
    hits = [v for v in report.warnings if v.rule == rule]
    assert hits, f"{rule} not warned for {bad}: {report}"
    assert field in str(hits[0]) and "Fix: " in str(hits[0])
    assert rule not in {v.rule for v in validate(compose(*good)).warnings}


def test_all_violations_reported_at_once(compose):
    report = validate(
        compose(
            "model=llama3_8b",
            "cluster=h100_cluster",
            "parallel.tp=3",
            "parallel.pp=5",
            "precision=fp16",
            "precision.loss_scaling=none",
            "backend=deepspeed",
            "zero=3",
        )
    )
    rules = {v.rule for v in report.errors}
    assert {
        "world_size",
        "tp_heads",
        "tp_ffn",
        "pp_layers",
        "zero_pipeline",
        "deepspeed_layout",
        "fp16_loss_scale",
    } <= rules


def test_every_recipe_is_valid(compose):
    from toolkit.config.store import conf_dir

    recipes = sorted(p.stem for p in (conf_dir() / "recipe").glob("*.yaml"))
    assert len(recipes) >= 5
    for name in recipes:
        cfg = compose(f"recipe={name}")
        assert cfg.description, name
        assert validate(cfg).ok, (name, validate(cfg))


def _float_paths(section, prefix=""):
    """The path of every float field of a configuration, nested sections included."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _float_paths(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_non_finite_float_is_refused_by_name(compose, value):
    paths = sorted(_float_paths(compose("train.fault.watchdog_timeout_s=60", "checkpoint.interval_minutes=5")))
    assert len(paths) > 25 and "optim.lr" in paths and "cluster.peak_tflops_bf16" in paths
    report = validate(compose(*(f"{path}={value}" for path in paths)))  # the other rules must not trip on them
    named = {field for v in report.errors if v.rule == "finite" for field in v.fields}
    assert named == set(paths), set(paths) ^ named
    assert all("Fix: set " in str(v) for v in report.errors if v.rule == "finite")


def test_non_finite_reported_with_the_other_errors(compose):
    rules = {v.rule for v in validate(compose("optim.lr=nan", "parallel.tp=3", "precision=fp16")).errors}
    assert {"finite", "world_size", "fp16_cpu"} <= rules


def test_plan_refuses_a_non_finite_number(compose, capsys):
    from toolkit.plan.report import plan_command

    assert plan_command(compose("optim.lr=nan")) == 2
    out = capsys.readouterr().out
    assert "optim.lr=nan" in out
    # no layout is valid because of the number, not memory: no "no layout fits" advice
    assert "the errors above do not depend on the layout" in out and "no layout fits" not in out


def test_plan_with_no_layout_to_search_says_why(compose, capsys):
    """8e9 GPUs leave no data-parallel size that divides a batch of 16: not "errors that do not
    depend on the layout" (they do), but the size and the batch."""
    from toolkit.plan.report import plan_command

    assert plan_command(compose("model=llama3_8b", "cluster=h100_cluster", "cluster.nodes=1000000000")) == 2
    out = capsys.readouterr().out
    assert "no layout to search: no split of 8,000,000,000 GPUs" in out and "do not depend on the layout" not in out


def test_layout_search_ignores_the_data_rules(compose):
    """The planner's layouts do not depend on the data: a model smaller than the corpus's
    tokenizer still gets its layouts (parakit plan model=mistral_7b)."""
    from toolkit.plan.search import search

    cfg = compose("model=mistral_7b", H100, "train=pretrain", "train.global_batch=256")
    assert cfg.data.name == "corpus" and not validate(cfg).ok
    assert validate(cfg, data=False).ok
    assert search(cfg).ranked


def test_a_package_an_option_needs_is_refused_only_where_it_is_missing_on_the_machine_that_trains(compose):
    """fp8 needs Transformer Engine (megatron-core's local spec would run bf16 silently). Where the
    run trains (`installed` given) a missing TE is an error naming the package; where it is
    importable, none; planning elsewhere (no `installed`) lists it and refuses nothing."""
    fp8 = compose(H100, "precision=fp8")
    missing = validate(fp8, installed=lambda module: False)
    hits = [v for v in missing.errors if v.rule == "package"]
    assert hits and "precision.dtype" in str(hits[0]) and "transformer-engine[pytorch]" in hits[0].fix
    assert "precision=bf16" in hits[0].fix
    assert validate(fp8, installed=lambda module: module == "transformer_engine.pytorch").ok
    planned = validate(fp8)
    assert planned.ok and [p.install for p in planned.packages] == ["transformer-engine[pytorch]"]
    assert "needs on the machines that train: transformer-engine[pytorch]" in str(planned)
    bf16 = validate(compose(H100, "precision=bf16"), installed=lambda module: False)
    assert bf16.ok and not bf16.packages  # context parallel, sequence parallel, windows: no TE needed
    assert validate(
        compose(H100, "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"),
        installed=lambda module: False,
    ).ok
    # the tensor-parallel communication overlap lives in TE's userbuffers: the same, for its field
    overlap = compose(H100, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true")
    hits = [v for v in validate(overlap, installed=lambda module: False).errors if v.rule == "package"]
    assert hits and "parallel.tp_comm_overlap" in str(hits[0]) and "parallel.tp_comm_overlap=false" in hits[0].fix
    assert validate(overlap, installed=lambda module: module == "transformer_engine.pytorch").ok


def test_a_missing_init_checkpoint_is_refused_before_any_rank_starts(compose, tmp_path):
    """The ranks would each fail to load it; the validator names the field and the fix once."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, what in ((tmp_path / "nowhere", "no such directory"), (empty, "no metadata.json")):
        errors = [e for e in validate(compose(f"train.init_checkpoint={path}")).errors if e.rule == "init_checkpoint"]
        assert len(errors) == 1 and "train.init_checkpoint" in str(errors[0]) and what in str(errors[0]), errors
        assert "parakit convert hf-to-megatron" in str(errors[0])
    (empty / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    unsealed = [e for e in validate(compose(f"train.init_checkpoint={empty}")).errors if e.rule == "init_checkpoint"]
    assert len(unsealed) == 1 and "no manifest.json" in str(unsealed[0]) and "is a pickle" in str(unsealed[0])
    (empty / "manifest.json").write_text('{"files": {}}')
    assert not [e for e in validate(compose(f"train.init_checkpoint={empty}")).errors if e.rule == "init_checkpoint"]
