"""The validator's mixture-of-experts and expert-parallel rules (toolkit.plan.rules.experts): each
rejects a case naming the field and a fix, and accepts its neighbour. The base is the tiny MoE
model (4 experts, top-2) on the default 4 CPU ranks."""

import pytest

from toolkit.plan.validate import validate

MOE = "model=tiny_moe"
SP = "parallel.sequence_parallel=true"

# rule, overrides it rejects, neighbouring overrides it accepts, a field the message must name
CASES = [
    ("ep_dense", ["parallel.ep=2"], ["parallel.ep=1"], "parallel.ep"),
    ("moe_family", [MOE, "model.family=llama"], [MOE, "model.family=qwen3_moe"], "model.family"),
    ("moe_family", ["model.family=mixtral"], ["model.family=qwen3", "model.qk_layernorm=true"], "model.family"),
    (
        "family_qk_layernorm",
        ["model.family=qwen3"],
        ["model.family=qwen3", "model.qk_layernorm=true"],
        "model.qk_layernorm",
    ),
    ("family_qk_layernorm", ["model.qk_layernorm=true"], ["model.qk_layernorm=false"], "model.qk_layernorm"),
    ("moe_topk", [MOE, "model.moe.router_topk=5"], [MOE, "model.moe.router_topk=4"], "model.moe.router_topk"),
    (
        "moe_ep",
        [MOE, "model.moe.num_experts=6", "parallel.ep=4"],
        [MOE, "model.moe.num_experts=8", "parallel.ep=4"],
        "parallel.ep",
    ),
    # tp2 ep4: etp follows tp, so each MoE layer wants 8 of the stage's 4 ranks
    (
        "expert_mesh",
        [MOE, "parallel.tp=2", SP, "parallel.ep=4"],
        [MOE, "parallel.tp=2", SP, "parallel.ep=4", "parallel.etp=1"],
        "parallel.etp",
    ),
    ("expert_mesh", [MOE, "parallel.pp=2", "parallel.ep=4"], [MOE, "parallel.pp=2", "parallel.ep=2"], "parallel.ep"),
    (
        "moe_ffn_etp",
        [MOE, "model.moe.ffn_hidden_size=99", "parallel.tp=2", SP],
        [MOE, "model.moe.ffn_hidden_size=100", "parallel.tp=2", SP],
        "model.moe.ffn_hidden_size",
    ),
    (
        "moe_shared_tp",
        [MOE, "model.moe.shared_expert_size=99", "parallel.tp=2", SP, "parallel.etp=1"],
        [MOE, "model.moe.shared_expert_size=100", "parallel.tp=2", SP, "parallel.etp=1"],
        "model.moe.shared_expert_size",
    ),
    ("moe_tp_sp", [MOE, "parallel.tp=2"], [MOE, "parallel.tp=2", SP], "parallel.sequence_parallel"),
    (
        "moe_tp_sp",
        [MOE, "parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
        [MOE, "parallel.tp=2", "parallel.ep=2", "parallel.etp=1", SP],
        "parallel.sequence_parallel",
    ),
    (
        "moe_top1_softmax",
        [MOE, "model.moe.router_topk=1"],
        [MOE, "model.moe.router_topk=1", "model.moe.norm_topk_prob=false"],
        "model.moe.norm_topk_prob",
    ),
    (
        "moe_expert_bias_score",
        [MOE, "model.moe.load_balancing=expert_bias"],
        [MOE, "model.moe.load_balancing=expert_bias", "model.moe.score_function=sigmoid"],
        "model.moe.score_function",
    ),
    (
        "moe_capacity_balancing",
        [
            MOE,
            "model.moe.load_balancing=expert_bias",
            "model.moe.score_function=sigmoid",
            "model.moe.capacity_factor=1.0",
        ],
        [MOE, "model.moe.capacity_factor=1.0"],
        "model.moe.capacity_factor",
    ),
    (
        "moe_pad_capacity",
        [MOE, "model.moe.pad_to_capacity=true"],
        [MOE, "model.moe.pad_to_capacity=true", "model.moe.capacity_factor=1.25"],
        "model.moe.pad_to_capacity",
    ),
    (
        "moe_flex_ranks",
        [MOE, "model.moe.token_dispatcher=flex"],
        [MOE, "model.moe.token_dispatcher=flex", "parallel.ep=2"],
        "model.moe.token_dispatcher",
    ),
    (
        "moe_dense_layers",
        [MOE, "model.moe.dense_layers=[4]"],
        [MOE, "model.moe.dense_layers=[3]"],
        "model.moe.dense_layers",
    ),
    (
        "moe_no_layers",
        [MOE, "model.moe.dense_layers=[0,1,2,3]"],
        [MOE, "model.moe.dense_layers=[0,1,2]"],
        "model.moe.dense_layers",
    ),
    # the deepspeed backend trains transformers' MoE blocks (toolkit.families.base.Family.unexpressed)
    (
        "moe_family_backend",
        [MOE, "backend=deepspeed", "zero=3", "model.moe.norm_topk_prob=false"],
        [MOE, "zero=3", "model.moe.norm_topk_prob=false"],
        "model.moe.norm_topk_prob",
    ),
    (
        "moe_family_backend",
        [MOE, "backend=deepspeed", "model.moe.capacity_factor=1.0"],
        [MOE, "backend=deepspeed", "model.moe.z_loss_coeff=1e-3", "model.moe.load_balancing=seq_aux_loss"],
        "model.moe.capacity_factor",
    ),
    (
        "moe_family_backend",
        [MOE, "backend=deepspeed", "model.moe.dense_layers=[1]"],
        [MOE, "backend=deepspeed", "model.family=qwen3_moe", "model.qk_layernorm=true", "model.moe.dense_layers=[1]"],
        "model.moe.dense_layers",
    ),
    (
        "moe_family_backend",
        [MOE, "backend=deepspeed", "model.moe.score_function=sigmoid"],
        [MOE, "model.moe.score_function=sigmoid"],
        "model.moe.score_function",
    ),
    (
        "moe_family_backend",
        [MOE, "backend=deepspeed", "model.family=qwen2_moe"],
        [
            MOE,
            "backend=deepspeed",
            "model.family=qwen2_moe",
            "model.moe.shared_expert_size=96",
            "model.moe.shared_expert_gate=true",
        ],
        "model.moe.shared_expert_size",
    ),
    (
        "moe_grouped_gemm_backend",
        [MOE, "backend=deepspeed", "model.moe.grouped_gemm=true"],
        [MOE, "backend=deepspeed"],
        "model.moe.grouped_gemm",
    ),
    (
        "moe_pipeline_backend",
        [MOE, "backend=deepspeed", "parallel.pp=2", "zero=1"],
        [MOE, "parallel.pp=2", "zero=1"],
        "parallel.pp",
    ),
    ("deepspeed_layout", [MOE, "backend=deepspeed", "parallel.ep=2"], [MOE, "parallel.ep=2"], "parallel.ep"),
    ("range", [MOE, "parallel.ep=0"], [MOE, "parallel.ep=1"], "parallel.ep"),
    (
        "range",
        [MOE, "model.moe.num_experts=0"],
        [MOE, "model.moe.num_experts=1", "model.moe.router_topk=1", "model.moe.norm_topk_prob=false"],
        "model.moe.num_experts",
    ),
]


@pytest.mark.parametrize("rule,bad,good,field", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_an_expert_rule_rejects_with_its_field_and_fix_and_accepts_the_neighbour(compose, rule, bad, good, field):
    hits = [v for v in validate(compose(*bad)).errors if v.rule == rule]
    assert hits, validate(compose(*bad))
    assert field in str(hits[0]) and hits[0].fix
    assert not [v for v in validate(compose(*good)).errors if v.rule == rule], validate(compose(*good))


def test_an_unset_etp_says_what_it_resolves_to(compose):
    """tp2 ep2 with etp unset: megatron-core splits each expert over the tp ranks too; the
    validator says so (a warning naming both choices), and is quiet once etp is set."""
    (warning,) = [
        v for v in validate(compose(MOE, "parallel.tp=2", SP, "parallel.ep=2")).warnings if v.rule == "etp_follows_tp"
    ]
    assert "etp*ep = 4 ranks" in warning.message and "parallel.etp=2" in warning.fix and "parallel.etp=1" in warning.fix
    for etp in (1, 2):
        report = validate(compose(MOE, "parallel.tp=2", SP, "parallel.ep=2", f"parallel.etp={etp}"))
        assert report.ok and not [v for v in report.warnings if v.rule == "etp_follows_tp"]


def test_grouped_gemm_and_the_flex_dispatcher_need_their_packages_where_the_run_trains(compose):
    for option, field in (
        ("model.moe.grouped_gemm=true", "model.moe.grouped_gemm"),
        ("model.moe.token_dispatcher=flex", "model.moe.token_dispatcher"),
    ):
        cfg = compose(MOE, "parallel.ep=2", option)
        assert validate(cfg).ok and field in validate(cfg).needs()
        (missing,) = [v for v in validate(cfg, installed=lambda module: False).errors if v.rule == "package"]
        assert field in str(missing)
        assert validate(cfg, installed=lambda module: True).ok


def test_a_backend_without_experts_refuses_a_mixture_of_experts(compose, monkeypatch):
    """Every backend trains some mixtures of experts today: a description without them shows the
    entry acts, and its fix names the backends that have them."""
    import dataclasses

    from toolkit.plan import backends
    from toolkit.plan.rules import capabilities

    cfg = compose(MOE, "backend=deepspeed")
    assert not [v for v in capabilities.backend(cfg) if v.rule.startswith("moe_")]
    dense_only = dataclasses.replace(backends.backend_of(cfg), moe=None)
    monkeypatch.setattr(capabilities, "backend_of", lambda cfg: dense_only)
    (hit,) = [v for v in capabilities.backend(cfg) if v.rule.startswith("moe_")]
    assert hit.rule == "moe_backend" and hit.fields == {"model.moe.num_experts": 4, "backend.name": "deepspeed"}
    assert hit.fix == "use backend=megatron or backend=deepspeed"


def test_deepspeed_says_why_it_has_no_expert_parallel(compose):
    (hit,) = [v for v in validate(compose(MOE, "backend=deepspeed", "parallel.ep=2")).errors]
    assert hit.rule == "deepspeed_layout" and "refuses ZeRO-3" in hit.message and "backend=megatron" in hit.fix


def test_stages_with_unequal_moe_layers_are_warned_about(compose):
    """Layers 0 and 1 dense at pp=2: the first stage holds no MoE layer, the second both; with
    layers 0 and 2 dense each stage holds one (quiet)."""
    two = ["cluster.gpus_per_node=2", "parallel.pp=2"]
    (warning,) = [
        v
        for v in validate(compose(MOE, *two, "model.moe.dense_layers=[0,1]")).warnings
        if v.rule == "moe_stage_imbalance"
    ]
    assert "hold 0, 2 MoE layers" in warning.message and "first_stage_layers" in warning.fix
    assert not [
        v
        for v in validate(compose(MOE, *two, "model.moe.dense_layers=[0,2]")).warnings
        if v.rule.startswith("moe_stage")
    ]
