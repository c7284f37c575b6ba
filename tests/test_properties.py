"""Property-based: over random override sets the validator raises nothing but ValidationError,
and whatever it accepts, DeepSpeed and megatron-core accept too (and every file renders)."""
import logging
import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from upstream import deepspeed_accepts, megatron_accepts

from toolkit.config.store import compose_config
from toolkit.emit.deepspeed import deepspeed_config
from toolkit.emit.files import render
from toolkit.emit.megatron import megatron_sections
from toolkit.plan.validate import ValidationError, check

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
# CI replays the same examples every run; locally each run explores new ones.
settings.register_profile("parakit", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=bool(os.environ.get("CI")))
settings.load_profile("parakit")

MODELS = ["tiny", "gpt2_124m", "llama3_1b", "llama3_8b", "llama3_70b", "llama3_405b", "gpt3_175b"]
CLUSTERS = ["cpu", "1xh200", "8xh100", "h100_cluster", "a100_cluster", "v100_cluster"]
ZERO = ["0", "1", "2", "3", "2_offload", "3_offload"]
PRECISION = ["fp32", "bf16", "fp16", "fp8"]
RECOMPUTE = ["none", "selective", "full"]


def _opt(key, values):
    """An optional override key=value (omitted when None is drawn)."""
    return st.one_of(st.none(), values.map(lambda v: f"{key}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"))


ANY_OVERRIDES = st.tuples(
    _opt("model", st.sampled_from(MODELS)),
    _opt("cluster", st.sampled_from(CLUSTERS)),
    _opt("zero", st.sampled_from(ZERO)),
    _opt("precision", st.sampled_from(PRECISION)),
    _opt("recompute", st.sampled_from(RECOMPUTE)),
    _opt("backend", st.sampled_from(["megatron", "deepspeed"])),
    _opt("parallel.tp", st.integers(-1, 9)),
    _opt("parallel.pp", st.integers(-1, 9)),
    _opt("parallel.vpp", st.integers(0, 5)),
    _opt("parallel.cp", st.integers(0, 3)),
    _opt("parallel.dp", st.one_of(st.none(), st.integers(-1, 64))),
    _opt("parallel.sequence_parallel", st.booleans()),
    _opt("cluster.nodes", st.integers(0, 64)),
    _opt("cluster.gpus_per_node", st.integers(0, 9)),
    _opt("train.global_batch", st.integers(-1, 4096)),
    _opt("train.micro_batch", st.integers(0, 17)),
    _opt("train.grad_accum", st.one_of(st.none(), st.integers(0, 64))),
    _opt("train.steps", st.one_of(st.none(), st.integers(0, 1000))),
    _opt("train.tokens", st.one_of(st.none(), st.integers(0, 10**12))),
    _opt("model.seq_length", st.sampled_from([1, 127, 128, 512, 1024, 2048, 4096, 8192, 200000])),
    _opt("model.make_vocab_size_divisible_by", st.sampled_from([-1, 0, 1, 64, 128])),
    _opt("recompute.num_layers", st.integers(-1, 9)),
    _opt("recompute.method", st.sampled_from(["uniform", "block", "bogus"])),
    _opt("precision.loss_scaling", st.sampled_from(["dynamic", "static", "none"])),
    _opt("optim.lr_scaling", st.sampled_from(["none", "linear", "sqrt"])),
    _opt("optim.reference_global_batch", st.one_of(st.none(), st.integers(0, 4096))),
    _opt("optim.warmup_steps", st.integers(-1, 3000)),
    _opt("optim.min_lr", st.sampled_from([0.0, 1e-5, 1.0])),
    _opt("optim.decay_style", st.sampled_from(["cosine", "linear", "constant", "wsd"])),
).map(lambda overrides: [o for o in overrides if o is not None])


@st.composite
def plausible_overrides(draw):
    """Layouts that fit their cluster by construction, so that many pass the validator."""
    tp, pp, vpp, cp, dp = (draw(st.sampled_from(v)) for v in ([1, 2, 4, 8], [1, 2, 4], [1, 2], [1, 2], [1, 2, 4]))
    micro, accum = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4, 8, 16]))
    gpu = draw(st.sampled_from(["8xh100", "h100_cluster", "a100_cluster"]))
    return [
        f"model={draw(st.sampled_from(MODELS[1:]))}", f"cluster={gpu}", f"cluster.nodes={pp * cp * dp}",
        f"cluster.gpus_per_node={tp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.cp={cp}",
        f"parallel.sequence_parallel={str(tp > 1 and draw(st.booleans())).lower()}",
        f"zero={draw(st.sampled_from(ZERO))}", f"precision={draw(st.sampled_from(PRECISION))}",
        f"recompute={draw(st.sampled_from(RECOMPUTE))}", f"backend={draw(st.sampled_from(['megatron', 'deepspeed']))}",
        f"train.micro_batch={micro}", f"train.global_batch={micro * dp * accum}", "train.steps=100",
        "model.seq_length=2048", "optim.warmup_steps=10",
    ]


def _judge(overrides):
    cfg = compose_config(overrides)
    try:
        layout, _ = check(cfg)
    except ValidationError as e:
        assert e.report.errors
        event("rejected")
        return
    event("accepted")
    ds = deepspeed_accepts(deepspeed_config(cfg, layout), dp=layout.dp, mp=layout.tp * layout.pp)
    assert ds.train_batch_size == layout.micro_batch * layout.grad_accum * layout.dp
    transformer, _, _ = megatron_accepts(megatron_sections(cfg, layout))
    assert transformer.num_layers == cfg.model.num_layers
    assert set(render(cfg, layout)) == {"config.yaml", "deepspeed.json", "megatron.yaml", "megatron_args.txt", "launch.sh"}


@settings(max_examples=60)
@given(ANY_OVERRIDES)
def test_validator_raises_only_its_own_error_on_any_overrides(overrides):
    _judge(overrides)


@settings(max_examples=60)
@given(plausible_overrides())
def test_whatever_validator_accepts_upstream_accepts(overrides):
    _judge(overrides)
