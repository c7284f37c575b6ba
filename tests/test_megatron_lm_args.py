"""megatron_args.txt trains what megatron.yaml says: Megatron-LM's parser, rebuilt from its option
table, reads each shipped recipe's command line, and every field of megatron.yaml's sections comes
out the same (tests/megatron_lm.py follows pretrain_gpt.py from the parsed arguments to
megatron-core's configuration classes); the fields no flag carries are listed, with the reason, in
toolkit.emit.megatron_args.FIELDS. The property test (test_properties.py) checks the same over drawn
configurations."""

import pytest
from megatron_lm import FLAGS, PARSER, differences, sections, words

from toolkit.config.store import conf_dir
from toolkit.emit import megatron_args as emit
from toolkit.emit.megatron import megatron_sections
from toolkit.emit.megatron_args import FIELDS, Flag, Implied, Unflagged, megatron_args
from toolkit.plan.checkpoint import checkpoint_plan
from toolkit.plan.perf import estimate_step
from toolkit.plan.validate import check

RECIPES = sorted(p.stem for p in (conf_dir() / "recipe").glob("*.yaml"))
# what the recipes leave out: each a field megatron.yaml says otherwise
CASES = {
    "bf16_grads_reduced_in_bf16": ["recipe=llama3_8b_8xh100", "precision.grad_reduce_in_fp32=false"],
    "fp16_dynamic": ["recipe=llama3_8b_8xh100", "precision=fp16"],
    "fp16_static": ["recipe=llama3_8b_8xh100", "precision=fp16", "precision.loss_scaling=static"],
    "fp32_gpu": ["model=gpt2_124m", "cluster=8xh100", "precision=fp32", "train.global_batch=64", "data=synthetic"],
    "selective_recompute": ["recipe=llama3_8b_8xh100", "recompute=selective", "recompute.modules=[core_attn,mlp]"],
    "full_recompute": [
        "recipe=llama3_70b_64xh100",
        "recompute=full",
        "recompute.method=block",
        "recompute.num_layers=2",
    ],
    "uneven_stages": [
        "recipe=llama3_8b_8xh100",
        "parallel.cp=1",
        "parallel.tp=2",
        "parallel.pp=4",
        "parallel.first_stage_layers=5",
        "parallel.last_stage_layers=9",
    ],
    "sliding_window_qwen2": [
        "model=qwen2_0_5b",
        "cluster=8xh100",
        "train.global_batch=64",
        "data=synthetic",
        "model.sliding_window=1024",
    ],
    "context_parallel_all_gather": ["recipe=llama3_70b_64xh100", "parallel.cp_comm_type=all_gather"],
    "comm_options": [
        "recipe=llama3_8b_8xh100",
        "parallel.tp=2",
        "comm.optimizer_instances=2",
        "comm.bucket_size=40000000",
    ],
    "moe_options": [
        "recipe=mixtral_8x7b_64xh100",
        "model.moe.z_loss_coeff=0.001",
        "model.moe.capacity_factor=1.25",
        "model.moe.pad_to_capacity=true",
        "model.moe.norm_topk_prob=false",
        "model.moe.shared_expert_size=2048",
        "model.moe.shared_expert_gate=true",
    ],
    "moe_expert_bias": [
        "recipe=mixtral_8x7b_64xh100",
        "model.moe.load_balancing=expert_bias",
        "model.moe.score_function=sigmoid",
    ],
    "cpu_moe": ["recipe=tiny_cpu_moe"],
}


def command_line(compose, overrides):
    cfg = compose(*overrides, "checks.memory=off")
    layout, _ = check(cfg)
    ours = megatron_sections(cfg, layout)
    return cfg, layout, ours, "\n".join(megatron_args(cfg, layout, ours))


@pytest.mark.parametrize(
    "overrides", [[f"recipe={r}"] for r in RECIPES] + list(CASES.values()), ids=RECIPES + list(CASES)
)
def test_megatron_lm_reads_back_every_field_of_megatron_yaml(compose, overrides):
    cfg, layout, ours, text = command_line(compose, overrides)
    assert not differences(text, ours, layout.world_size)
    assert {w for w in words(text) if w.startswith("--")} <= FLAGS
    # pretrain_gpt.py divides the run by it, evaluating or not (training.py get_train_valid_test_num_samples)
    assert "--eval-interval" in words(text)
    theirs = sections(text, ours, layout.world_size)
    # The planner prices Transformer Engine's fused kernels on GPUs, parakit's trainer builds TE's layers
    # where TE is installed, and Megatron-LM's GPT builder takes its local spec otherwise, whose attention
    # refuses context parallel (megatron/core/transformer/dot_product_attention.py).
    gpu = cfg.cluster.device == "cuda"
    assert theirs["transformer"]["transformer_impl"] == ("transformer_engine" if gpu else "local")


def test_every_field_has_its_flag_or_a_reason(compose):
    """Every field of the sections is in the table or has a flag of its own name in Megatron-LM;
    the table's flags are Megatron-LM's, and each field without one says why."""
    _, _, ours, _ = command_line(compose, CASES["moe_options"])
    for section, fields in ours.items():
        for field in fields:
            if field not in FIELDS:
                assert "--" + field.replace("_", "-") in FLAGS, f"{section}.{field}: no flag of its name in Megatron-LM"
    for field, how in FIELDS.items():
        if isinstance(how, Flag):
            assert how.name in FLAGS, (field, how.name)
        elif isinstance(how, (Implied, Unflagged)):
            assert (how.how if isinstance(how, Implied) else how.why).strip(), field


@pytest.mark.mutation
@pytest.mark.parametrize(
    "defect,case,field",
    [
        ("mixtures of experts dropped", "moe_options", "transformer.num_moe_experts"),
        (
            "bf16 gradients: only --accumulate-allreduce-grads-in-fp32 left out",
            "bf16_grads_reduced_in_bf16",
            "ddp.grad_reduce_in_fp32",
        ),
        ("--qk-layernorm dropped", "qwen3_235b_a22b_256xh100", "transformer.qk_layernorm"),
    ],
)
def test_the_read_back_catches_a_field_the_command_line_loses(compose, monkeypatch, defect, case, field):
    """megatron_args.py's defects the issue found (issue 41), put back one at a time."""
    name = field.split(".")[1]
    flags = emit._flags
    if name == "grad_reduce_in_fp32":
        monkeypatch.setitem(
            FIELDS, name, lambda fp32, fields: [["--accumulate-allreduce-grads-in-fp32"]] if fp32 else []
        )
    else:
        monkeypatch.setattr(emit, "_flags", lambda n, v, f: [] if n.startswith(("moe_", name)) else flags(n, v, f))
    _, layout, ours, text = command_line(compose, CASES.get(case, [f"recipe={case}"]))
    found = differences(text, ours, layout.world_size)
    assert any(line.startswith(field + ":") for line in found), (defect, found)


@pytest.mark.parametrize("end, steps", [(None, (5, 6)), (8, (5, 8))])
def test_the_profiled_steps_reach_megatron_lm(compose, end, steps):
    """train.profile_step_start/_end: Megatron-LM's torch.profiler over the same steps on rank 0."""
    overrides = ["recipe=llama3_8b_8xh100", "train.profile_step_start=5"] + [f"train.profile_step_end={end}"] * bool(
        end
    )
    _, _, _, text = command_line(compose, overrides)
    parsed = PARSER.parse_args(words(text))
    assert parsed.profile and parsed.use_pytorch_profiler and parsed.profile_ranks == [0]
    assert (parsed.profile_step_start, parsed.profile_step_end) == steps
    _, _, _, plain = command_line(compose, ["recipe=llama3_8b_8xh100"])
    assert not PARSER.parse_args(words(plain)).profile


def test_save_on_stop_reaches_megatron_lm(compose):
    """train.fault.save_on_stop: Megatron-LM's --exit-signal-handler (save after the iteration, exit)."""
    for save, handled in ((["train.fault.save_on_stop=true"], True), ([], False)):
        _, _, _, text = command_line(compose, ["recipe=llama3_8b_8xh100", *save])
        assert PARSER.parse_args(words(text)).exit_signal_handler is handled


@pytest.mark.parametrize(
    "checkpoint, interval",
    [
        (["checkpoint.interval_steps=500"], lambda cfg, layout, step: 500),
        (["checkpoint.interval_minutes=30"], lambda cfg, layout, step: round(30 * 60 / step)),
        (  # parakit saves at whichever comes first
            ["checkpoint.interval_steps=500", "checkpoint.interval_minutes=30"],
            lambda cfg, layout, step: min(500, round(30 * 60 / step)),
        ),
        (
            ["checkpoint.auto_interval=true"],
            lambda cfg, layout, step: checkpoint_plan(cfg, layout, step).recommended_steps,
        ),
        ([], lambda cfg, layout, step: None),
    ],
    ids=["steps", "minutes", "steps_and_minutes", "auto", "none"],
)
def test_megatron_lm_saves_at_the_interval_parakit_plans(compose, checkpoint, interval):
    """checkpoint.*: Megatron-LM counts only steps (--save-interval); minutes and the planner's rule
    are converted with the planner's step time; no interval, no --save-interval (launch.sh then
    gives no --save either: Megatron-LM's last save divides by it)."""
    cfg, layout, _, text = command_line(compose, ["recipe=llama3_8b_8xh100", *checkpoint])
    step = estimate_step(cfg, layout).step_time
    assert PARSER.parse_args(words(text)).save_interval == interval(cfg, layout, step)
    assert 0 < step < 1800  # the minutes case converts to more than one step


def test_megatron_lm_logs_to_the_wandb_project_parakit_would(compose):
    _, _, _, text = command_line(
        compose,
        [
            "recipe=llama3_8b_8xh100",
            "train.loggers=[jsonl,wandb]",
            "train.tracker_project=p1",
            "train.wandb_entity=team",
        ],
    )
    parsed = PARSER.parse_args(words(text))
    assert (parsed.wandb_project, parsed.wandb_entity) == ("p1", "team")
    _, _, _, plain = command_line(compose, ["recipe=llama3_8b_8xh100"])
    assert not PARSER.parse_args(words(plain)).wandb_project
