"""The typed schema every parakit configuration is composed into.

Plain dataclasses, no Hydra import: `toolkit.plan` reads these objects without pulling in
Hydra or torch. `toolkit.config.store` registers them in Hydra's ConfigStore so that a wrong
type (`parallel.tp=abc`) or an unknown key fails at composition.

Names follow what users of Megatron-LM and DeepSpeed type: `parallel.tp`, `parallel.pp`,
`parallel.vpp`, `zero=0..3`, `precision=bf16`, `recompute=full`, `train.global_batch`.

Every closed set of values is a `StrEnum`: OmegaConf refuses any other value at composition and
names the allowed ones, while a member equals, hashes and formats as its string
(`cfg.precision.dtype == "bf16"`, `f"{cfg.precision.dtype}"`). OmegaConf looks a value up by
member *name*, so every member is named as its value. yaml.safe_dump refuses str subclasses:
`plain()` turns a configuration into the built-in types it writes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any, Optional


# ---------------------------------------------------------------- closed sets of values
class Family(StrEnum):
    """The Hugging Face architecture a model maps to."""

    llama = "llama"
    qwen2 = "qwen2"
    mistral = "mistral"
    gpt2 = "gpt2"
    mixtral = "mixtral"
    qwen3 = "qwen3"
    qwen3_moe = "qwen3_moe"
    qwen2_moe = "qwen2_moe"


class LoadBalancing(StrEnum):
    """How the router keeps the experts evenly loaded (megatron-core's
    moe_router_load_balancing_type, TransformerConfig)."""

    aux_loss = "aux_loss"  # a loss over the micro-batch's tokens (Fedus et al. 2021, "Switch Transformers", eq. 4)
    seq_aux_loss = "seq_aux_loss"  # the same per sequence (DeepSeek-AI 2024, "DeepSeek-V3", eq. 17-20)
    # no loss: a per-expert bias on the routing scores, nudged towards even load after each step
    # (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing"; DeepSeek-V3 section 2.1.2)
    expert_bias = "expert_bias"
    none = "none"


class TokenDispatcher(StrEnum):
    """How tokens reach their experts' ranks (megatron-core's moe_token_dispatcher_type)."""

    alltoall = "alltoall"  # each rank sends each expert rank its tokens (all-to-all)
    allgather = "allgather"  # every rank gathers every token and keeps its experts' (small ep)
    flex = "flex"  # DeepEP's or HybridEP's fused kernels (packages of their own, CUDA)


class TokenDropPolicy(StrEnum):
    """Which tokens an expert over capacity drops (megatron-core's moe_token_drop_policy)."""

    probs = "probs"  # the lowest routing probabilities
    position = "position"  # the latest in the sequence


class RouterScore(StrEnum):
    """The function of the router's logits that ranks the experts (megatron-core's moe_router_score_function)."""

    softmax = "softmax"
    sigmoid = "sigmoid"  # DeepSeek-V3 (section 2.1.2), and what the expert bias needs


class Normalization(StrEnum):
    RMSNorm = "RMSNorm"
    LayerNorm = "LayerNorm"


class Activation(StrEnum):
    swiglu = "swiglu"
    gelu = "gelu"  # exact (erf) GeLU
    gelu_tanh = "gelu_tanh"  # tanh approximation: GPT-2's gelu_new, Megatron-LM's --openai-gelu


class PositionEmbedding(StrEnum):
    rope = "rope"
    learned_absolute = "learned_absolute"


class RopeScalingType(StrEnum):
    """How RoPE's frequencies are stretched beyond the pretraining context."""

    none = "none"  # plain RoPE
    llama3 = "llama3"  # Llama 3.1's frequency-dependent interpolation ("rope_type": "llama3" in HF)


class Offload(StrEnum):
    """Where ZeRO offloads optimizer states or parameters."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class Dtype(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"


class LossScaling(StrEnum):
    dynamic = "dynamic"
    static = "static"
    none = "none"


class Fp8Format(StrEnum):
    """Transformer Engine's FP8 recipes."""

    hybrid = "hybrid"
    e4m3 = "e4m3"


class CpCommType(StrEnum):
    """How context parallel moves K and V between its ranks (megatron-core's cp_comm_type, run by
    Transformer Engine's attention)."""

    p2p = "p2p"  # a ring of sends, each hidden under the attention of the step before (the default)
    all_gather = "all_gather"  # all-gather K and V, then attend: exposed, but few bytes with GQA (Llama 3)


class RecomputeGranularity(StrEnum):
    none = "none"
    selective = "selective"
    full = "full"


class RecomputeMethod(StrEnum):
    """Megatron's --recompute-method (full recompute)."""

    uniform = "uniform"
    block = "block"


class RecomputeModule(StrEnum):
    """What selective recompute recomputes: megatron-core's recompute_modules that a dense GPT
    model has (the others need MoE, multi-latent or gated delta-net attention)."""

    core_attn = "core_attn"
    layernorm = "layernorm"
    mlp = "mlp"


class OptimizerName(StrEnum):
    adamw = "adamw"


class DecayStyle(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class LrScaling(StrEnum):
    """How the learning rate follows a global batch other than the one it was tuned at."""

    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class AttentionBackend(StrEnum):
    flash = "flash"
    unfused = "unfused"


class KernelChoice(StrEnum):
    """Which element-wise and loss kernels a run computes with (toolkit.plan.backends.kernels_of)."""

    auto = "auto"  # the fused ones on GPUs, the reference ones on CPU
    fused = "fused"  # fused kernels (megatron-core's fusions; Liger's for transformers models)
    reference = "reference"  # the plain PyTorch operations, one kernel each


class Logger(StrEnum):
    """Where a run's scalars go (toolkit.train.trackers)."""

    jsonl = "jsonl"  # <run dir>/metrics.jsonl, parakit's own record: written in any case (reports and resume read it)
    tensorboard = "tensorboard"  # <run dir>/tensorboard/
    wandb = "wandb"  # Weights & Biases (package wandb)
    mlflow = "mlflow"  # MLflow (package mlflow-skinny)


class WandbMode(StrEnum):
    offline = "offline"  # written under <run dir>/wandb/: `wandb sync` uploads it later
    online = "online"  # streamed to the W&B server (WANDB_API_KEY or `wandb login`)


class NanAction(StrEnum):
    skip = "skip"
    stop = "stop"


class Device(StrEnum):
    cuda = "cuda"
    cpu = "cpu"


class BackendName(StrEnum):
    """The training backends (toolkit.plan.backends describes each)."""

    megatron = "megatron"
    deepspeed = "deepspeed"


class DataName(StrEnum):
    synthetic = "synthetic"  # random tokens: throughput runs (the loss stays at ln(vocab))
    corpus = "corpus"  # a real corpus in a Megatron indexed dataset


class Tokenizer(StrEnum):
    gpt2 = "gpt2"


TOKENIZER_VOCAB = {Tokenizer.gpt2: 50257}  # tokens of each tokenizer (GPT-2 byte-level BPE)


def plain(value: Any) -> Any:
    """`value` (a configuration, a dataclass, or dicts and lists of them) in built-in types only:
    dataclasses as dicts, enum members as their values. What yaml.safe_dump writes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    return value


@dataclass(frozen=True)
class Bounds:
    """The values a number field may take, kept with the field (its metadata) and checked by the
    validator's range rules (toolkit.plan.rules.ranges), which report `message` and `fix` ({path}:
    the field's path). An unset (null) field is not checked."""

    message: str
    fix: str
    min: float | None = None  # inclusive; nan and inf are the finite rule's
    max: float | None = None  # inclusive
    below: float | None = None  # exclusive
    above: float | None = None  # exclusive, and -inf is below it
    choices: tuple | None = None
    pattern: str | None = None  # a text field (each item of a list of them) matches this regular expression whole
    rule: str = "range"
    required: bool = False  # null is refused too (a cluster file must say what its hardware has)


def _bounded(default, bounds: Bounds):
    return field(default=default, metadata={"bounds": bounds})


# A name: a config option (`cluster=NAME`), a file and folder name, the Slurm job's name.
NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
NAME_RULE = "letters, digits, '_', '.' and '-', not starting with '.'"


def as_name(text: str) -> str:
    """`text` made a NAME: every other character becomes '_' (a leading '.' too), so that it stays one
    file name inside its folder."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", text)
    return name if re.fullmatch(NAME, name) else "_" + name


def a_name(default):
    return _bounded(
        default,
        Bounds(
            f"must be a name: {NAME_RULE} (it names files, folders and the Slurm job)",
            "set {path} to such a name",
            pattern=NAME,
            rule="name",
        ),
    )


def one_line(default):
    return _bounded(
        default,
        Bounds(
            "must be one line of printable text (launch.sh writes it)",
            "remove the newlines and control characters from {path}",
            pattern=r"[^\x00-\x1f\x7f]*",
            rule="one_line",
        ),
    )


# A value launch.sh writes into an #SBATCH line, which sbatch reads itself: it splits the line at
# whitespace and takes quotes and backslashes as its own (Slurm's src/sbatch/opt.c, _get_argument);
# nothing of it reaches a shell.
SBATCH_VALUE = Bounds(
    "goes into an #SBATCH line, where sbatch splits at whitespace and reads quotes and backslashes as its own",
    "remove whitespace, quotes, backslashes and control characters from {path}",
    pattern=r"[^\s\"'\\\x00-\x1f\x7f]+",
    rule="sbatch_value",
)


# Slurm's partition, account and QOS names (letters, digits, '_', '.', '-'); a partition list is
# comma-separated (sbatch --partition=a,b).
SLURM_NAME = r"[A-Za-z0-9_.-]+"


def slurm_name(default, several: bool = False):
    pattern = f"{SLURM_NAME}(,{SLURM_NAME})*" if several else SLURM_NAME
    return _bounded(
        default,
        Bounds(
            "must be a Slurm name: letters, digits, '_', '.' and '-'" + (", comma-separated" * several),
            "set {path} to the name `sinfo` or `sacctmgr show` lists",
            pattern=pattern,
            rule="slurm_name",
        ),
    )


def sbatch_value(default):
    return _bounded(default, SBATCH_VALUE)


def path_text(default):
    """A file or folder path: one line, no control characters (launch.sh and messages print it)."""
    return _bounded(
        default,
        Bounds(
            "must be a path (not empty) on one line, without control characters",
            "give {path} a path, without newlines or control characters (or null where it may be unset)",
            pattern=r"[^\x00-\x1f\x7f]+",
            rule="path",
        ),
    )


# sbatch --time's formats (Slurm's sbatch(1)): "minutes", "minutes:seconds", "hours:minutes:seconds",
# "days-hours", "days-hours:minutes", "days-hours:minutes:seconds"; INFINITE or UNLIMITED for none.
SLURM_TIME = r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|INFINITE|UNLIMITED"


def slurm_time(default):
    return _bounded(
        default,
        Bounds(
            "is not a time limit sbatch reads (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED)",
            "set {path}=HH:MM:SS, e.g. 04:00:00, or D-HH:MM:SS for days",
            pattern=SLURM_TIME,
            rule="slurm_time",
        ),
    )


def hardware(default):
    """A hardware rate or size the planner divides by: positive, and a cluster file must give it."""
    return _bounded(
        default,
        Bounds(
            "must be given and positive (the planner divides by it)",
            "set {path} to the cluster's figure (its datasheet, or `parakit probe`)",
            above=0,
            required=True,
        ),
    )


def peak_or_zero(default):
    """A datasheet peak a cluster file must give; 0 where the accelerator lacks the format (V100's bf16)."""
    return _bounded(
        default,
        Bounds(
            "must be given and not negative (0: the accelerator lacks the format)",
            "set {path} to the datasheet's dense peak, TFLOP/s",
            min=0,
            required=True,
        ),
    )


def positive(default):
    return _bounded(default, Bounds("must be positive", "set {path} > 0", above=0))


def fraction(default):
    return _bounded(default, Bounds("is a fraction: it lies in (0, 1]", "set {path} in (0, 1]", above=0, max=1))


def at_least_one(default):
    return _bounded(default, Bounds("must be a positive integer", "set {path} >= 1", min=1))


def non_negative(default):
    return _bounded(default, NON_NEGATIVE)


def positive_or_null(default):
    return _bounded(default, Bounds("must be positive (null turns it off)", "set {path} > 0, or null", above=0))


def dropout(default):
    return _bounded(default, Bounds("a dropout rate lies in [0, 1)", "use 0.0 to 0.1", min=0, below=1))


def beta(default):
    return _bounded(
        default, Bounds("an Adam beta lies in [0, 1)", "set {path}=0.9 (beta1) or 0.95 (beta2)", min=0, below=1)
    )


NON_NEGATIVE = Bounds("must not be negative", "set {path} >= 0", min=0)


def zero_stage(default):
    return _bounded(
        default, Bounds("ZeRO has stages 0-3", "use zero=0, 1, 2 or 3", choices=(0, 1, 2, 3), rule="choice")
    )


@dataclass
class RopeScalingConfig:
    """Long-context RoPE scaling, as Hugging Face's `rope_parameters` / config.json `rope_scaling`.

    llama3 (Meta's Llama 3.1 reference code, `apply_scaling`; transformers
    `modeling_rope_utils._compute_llama3_parameters`): with wavelength w = 2*pi/inv_freq and
    L = original_max_position_embeddings, frequencies with w < L/high_freq_factor stay, those with
    w > L/low_freq_factor are divided by `factor`, and those between are interpolated smoothly.
    The numbers are read only when type is llama3; they default to Llama 3.1's values.
    """

    type: RopeScalingType = RopeScalingType.none
    factor: float = positive(8.0)  # how much the low frequencies are slowed down
    low_freq_factor: float = positive(1.0)  # wavelengths above L / low_freq_factor are divided by factor
    high_freq_factor: float = positive(4.0)  # wavelengths below L / high_freq_factor are kept
    original_max_position_embeddings: int = at_least_one(8192)  # L: the context the model was pretrained at


@dataclass
class MoeConfig:
    """Mixture-of-experts MLPs (Shazeer et al. 2017; top-k routing as Mixtral, Jiang et al. 2024),
    named as megatron-core's TransformerConfig moe_* fields. num_experts unset: a dense model."""

    num_experts: Optional[int] = at_least_one(None)
    router_topk: int = at_least_one(2)  # experts each token goes to
    # renormalise the top-k routing weights to sum to 1 (Mixtral, Qwen3-MoE: HF norm_topk_prob); off:
    # the softmax over all experts, kept for the top k (Qwen2-MoE; megatron-core moe_router_pre_softmax)
    norm_topk_prob: bool = True
    score_function: RouterScore = RouterScore.softmax
    ffn_hidden_size: Optional[int] = at_least_one(None)  # each expert's FFN size; unset: model.ffn_hidden_size
    # the shared experts' FFN size, all of them together (Qwen2-MoE, DeepSeek); unset: none
    shared_expert_size: Optional[int] = at_least_one(None)
    shared_expert_gate: bool = False  # a sigmoid gate on the shared experts' output (Qwen2-MoE)
    layer_freq: int = at_least_one(1)  # layer i is an MoE layer when i % layer_freq == 0 ...
    # ... and i is not listed here (0-based)
    dense_layers: list[int] = field(default_factory=list, metadata={"bounds": NON_NEGATIVE})
    load_balancing: LoadBalancing = LoadBalancing.aux_loss
    aux_loss_coeff: float = non_negative(1e-2)  # the load-balancing loss's weight
    z_loss_coeff: Optional[float] = positive_or_null(None)  # router z-loss (Zoph et al. 2022, "ST-MoE", eq. 5)
    expert_bias_update_rate: float = non_negative(1e-3)  # load_balancing=expert_bias's step
    # tokens an expert takes over its fair share (tokens x top-k / experts); unset: dropless
    capacity_factor: Optional[float] = positive_or_null(None)
    token_drop_policy: TokenDropPolicy = TokenDropPolicy.probs
    pad_to_capacity: bool = False  # pad every expert's input to its capacity (needs capacity_factor)
    token_dispatcher: TokenDispatcher = TokenDispatcher.alltoall
    grouped_gemm: bool = False  # all local experts in one grouped GEMM (needs the grouped_gemm package or TE)


@dataclass
class ModelConfig:
    """A decoder-only transformer, described once for every consumer (planner, Megatron, HF)."""

    name: str = a_name("tiny")
    family: Family = Family.llama  # the Hugging Face architecture it maps to
    sliding_window: Optional[int] = at_least_one(None)  # mistral: attend to the last N tokens only (this one included)
    num_layers: int = at_least_one(8)
    hidden_size: int = at_least_one(64)
    num_attention_heads: int = at_least_one(4)
    num_kv_heads: Optional[int] = at_least_one(None)  # None: multi-head attention (kv heads = heads)
    head_dim: Optional[int] = at_least_one(None)  # None: hidden_size / num_attention_heads
    ffn_hidden_size: int = at_least_one(256)
    vocab_size: int = at_least_one(50257)
    # Megatron pads the embedding to a multiple of this times tp (--make-vocab-size-divisible-by).
    make_vocab_size_divisible_by: int = non_negative(128)
    seq_length: int = at_least_one(128)  # training sequence length
    max_position_embeddings: int = at_least_one(128)  # the longest sequence the model supports
    normalization: Normalization = Normalization.RMSNorm
    norm_epsilon: float = non_negative(1e-5)
    activation: Activation = Activation.swiglu
    position_embedding: PositionEmbedding = PositionEmbedding.rope
    rotary_base: float = positive(10000.0)  # RoPE's theta (HF rope_theta)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    tie_embeddings: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    init_method_std: float = non_negative(0.02)
    hidden_dropout: float = dropout(0.0)
    attention_dropout: float = dropout(0.0)
    qk_layernorm: bool = False  # RMSNorm on each head's queries and keys (Qwen3; megatron-core qk_layernorm)
    moe: MoeConfig = field(default_factory=MoeConfig)
    # A local Hugging Face model directory (config.json + safetensors) whose weights training
    # starts from, on either backend (train.init_checkpoint, when set, replaces them); its
    # architecture must match the fields above. model=hf reads those fields from its config.json.
    hf_path: Optional[str] = path_text(None)


def head_dim(m: ModelConfig) -> int:
    """The size of one attention head (model.head_dim unset: hidden_size / heads)."""
    return m.head_dim or m.hidden_size // max(m.num_attention_heads, 1)  # 0 heads: refused by the range rule


def kv_heads(m: ModelConfig) -> int:
    """The number of key/value heads (model.num_kv_heads unset: one per attention head)."""
    return m.num_kv_heads or m.num_attention_heads


def is_moe(m: ModelConfig) -> bool:
    return m.moe.num_experts is not None


def expert_ffn_size(m: ModelConfig) -> int:
    """One expert's FFN size (model.moe.ffn_hidden_size unset: the dense model.ffn_hidden_size)."""
    return m.moe.ffn_hidden_size or m.ffn_hidden_size


def moe_layer_pattern(m: ModelConfig) -> list[int]:
    """1 for each MoE layer, 0 for each dense one (megatron-core's moe_layer_freq as a list,
    models/gpt/gpt_layer_specs.py): every layer_freq-th from layer 0, less those in dense_layers."""
    if not is_moe(m):
        return [0] * m.num_layers
    dense = set(m.moe.dense_layers)
    return [int(i % m.moe.layer_freq == 0 and i not in dense) for i in range(m.num_layers)]


@dataclass
class ParallelConfig:
    tp: int = at_least_one(1)  # tensor parallel size
    pp: int = at_least_one(1)  # pipeline parallel size
    vpp: int = at_least_one(1)  # virtual pipeline stages per pipeline rank (interleaved 1F1B when > 1)
    dp: Optional[int] = at_least_one(None)  # data parallel size; derived from the world size when left out
    cp: int = at_least_one(1)  # context parallel size (megatron backend)
    # Expert parallel: each MoE layer's experts split over ep ranks, and each expert's matrices over
    # etp ranks (unset: tp, as megatron-core). The experts fold into the ranks attention uses:
    # etp x ep x expert-dp = tp x cp x dp (megatron-core parallel_state, "MoE parallel folding").
    ep: int = at_least_one(1)
    etp: Optional[int] = at_least_one(None)
    cp_comm_type: CpCommType = CpCommType.p2p
    # Uneven pipeline: layers on the first / last stage (the rest split evenly over the middle
    # stages), e.g. Llama 3 405B's 126 layers on 16 stages as 7 + 14 x 8 + 7.
    first_stage_layers: Optional[int] = at_least_one(None)
    last_stage_layers: Optional[int] = at_least_one(None)
    sequence_parallel: bool = False  # Megatron sequence parallel (needs tp > 1)
    # Overlap tensor parallel's all-gathers and reduce-scatters with the GEMMs that use them
    # (megatron-core's tp_comm_overlap: Transformer Engine's userbuffers, CUDA, sequence parallel).
    tp_comm_overlap: bool = False


@dataclass
class ZeroConfig:
    """ZeRO stage. On the megatron backend stage 1 is Megatron's distributed optimizer."""

    stage: int = zero_stage(1)
    offload_optimizer: Offload = Offload.none
    offload_param: Offload = Offload.none  # stage 3 only
    nvme_path: Optional[str] = path_text(None)
    # Overlap the data-parallel communication with compute: DeepSpeed's overlap_comm (ZeRO 2/3),
    # megatron-core's overlap_grad_reduce and, with the distributed optimizer, overlap_param_gather.
    overlap_comm: bool = True
    reduce_bucket_size: int = at_least_one(500_000_000)
    allgather_bucket_size: int = at_least_one(500_000_000)
    stage3_prefetch_bucket_size: int = at_least_one(50_000_000)
    stage3_param_persistence_threshold: int = non_negative(100_000)
    stage3_max_live_parameters: int = at_least_one(1_000_000_000)


@dataclass
class CommConfig:
    """How the data-parallel gradients and parameters travel: the guide's remedies once data
    parallel reaches its limit, hierarchical and compressed synchronisation. Each is one backend's
    (the validator says which); precision.grad_reduce_in_fp32 chooses the reduction's dtype and
    zero.overlap_comm whether it overlaps the compute."""

    # megatron-core: the distributed optimizer shards its state over each of N groups of the
    # dp x cp ranks (a node each, ideally) and keeps N replicas: gradients reduce-scatter inside a
    # group and the shards all-reduce across the groups (num_distributed_optimizer_instances).
    optimizer_instances: int = at_least_one(1)
    # DeepSpeed ZeRO++ (Wang et al. 2023, "ZeRO++", arXiv 2306.10209), ZeRO-3 only. hpZ: a second copy
    # of the parameters sharded over this many ranks (a node), whose all-gathers in the backward stay
    # inside it (zero_hpz_partition_size); qwZ: the parameters all-gathered in int8
    # (zero_quantized_weights); qgZ: the gradients reduce-scattered in int4, node first
    # (zero_quantized_gradients).
    hpz_partition_size: int = at_least_one(1)
    quantized_weights: bool = False
    quantized_gradients: bool = False
    # megatron-core's gradient bucket (DistributedDataParallelConfig.bucket_size, elements); unset:
    # megatron-core's max(40M, 1M x dp)
    bucket_size: Optional[int] = at_least_one(None)


@dataclass
class PrecisionConfig:
    dtype: Dtype = Dtype.bf16  # conf/precision/auto.yaml (the default) takes cluster.default_dtype
    # fp16 needs loss scaling: dynamic (recommended), static (loss_scale), or none.
    loss_scaling: LossScaling = LossScaling.dynamic
    # static scale, used when loss_scaling=static; 0 would mean dynamic scaling to DeepSpeed and megatron-core
    loss_scale: float = _bounded(
        1.0,
        Bounds("a static loss scale must be positive", "set {path} > 0, or precision.loss_scaling=dynamic", above=0),
    )
    initial_scale_power: int = _bounded(  # dynamic: start at 2**power
        16, Bounds("the first loss scale 2**power must be a finite fp32 number", "set {path} in 0..64", min=0, max=64)
    )
    loss_scale_window: int = non_negative(1000)
    hysteresis: int = non_negative(2)
    min_loss_scale: float = non_negative(1.0)
    fp8_format: Fp8Format = Fp8Format.hybrid
    grad_reduce_in_fp32: bool = True


@dataclass
class RecomputeConfig:
    granularity: RecomputeGranularity = RecomputeGranularity.none
    method: RecomputeMethod = RecomputeMethod.uniform  # full only (Megatron --recompute-method)
    num_layers: int = non_negative(1)  # full only: layers per recompute chunk (uniform) or per stage (block)
    modules: list[RecomputeModule] = field(default_factory=lambda: [RecomputeModule.core_attn])  # selective only


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = non_negative(3e-4)
    min_lr: float = non_negative(3e-5)
    beta1: float = beta(0.9)
    beta2: float = beta(0.95)
    eps: float = non_negative(1e-8)
    weight_decay: float = non_negative(0.1)
    clip_grad: float = non_negative(1.0)
    warmup_steps: int = non_negative(100)
    decay_style: DecayStyle = DecayStyle.cosine
    decay_steps: Optional[int] = non_negative(None)  # None: decay over all training steps
    # Rescaling rule when the global batch differs from the batch lr/warmup were tuned at.
    lr_scaling: LrScaling = LrScaling.none
    reference_global_batch: Optional[int] = non_negative(None)


@dataclass
class FaultConfig:
    """Fault handling, and fault injection for tests and drills (injections act on the first
    attempt only, so that a restarted job runs through)."""

    max_restarts: int = non_negative(0)  # torchrun restarts the ranks this often; each resumes
    watchdog_timeout_s: Optional[float] = positive_or_null(None)  # end the job when a rank makes no progress this long
    # On a non-finite loss: skip (the update) | stop (keep the last good checkpoint).
    nan_action: NanAction = NanAction.stop
    kill_rank: Optional[int] = non_negative(None)  # this rank dies ...
    kill_at_step: Optional[int] = at_least_one(None)  # ... at the start of this step
    stall_rank: Optional[int] = non_negative(None)  # this rank hangs ...
    stall_at_step: Optional[int] = at_least_one(None)  # ... at the start of this step ...
    stall_seconds: float = non_negative(3600.0)  # ... for this long
    nan_at_step: Optional[int] = at_least_one(None)  # the loss of this step becomes NaN
    oom_rank: Optional[int] = non_negative(None)  # this rank runs out of device memory ...
    oom_at_step: Optional[int] = at_least_one(None)  # ... at the start of this step (raised as the allocator raises it)
    crash_in_save_at_step: Optional[int] = at_least_one(None)  # rank 0 dies after writing, before publishing, this save
    # the checkpoint of this step is damaged after publishing
    corrupt_checkpoint_at_step: Optional[int] = at_least_one(None)
    # A rank slower than the others, named: every straggler_interval steps the ranks' compute seconds
    # per step are compared (toolkit.train.stragglers), and one over its pipeline stage's median by more
    # than straggler_threshold (a fraction) is printed with its host, local rank and stage and recorded
    # in metrics.jsonl. null: never compared.
    straggler_interval: Optional[int] = at_least_one(10)
    straggler_threshold: float = positive(0.2)
    # drill: this rank computes slow_seconds longer at every step (a slow GPU, a throttled node)
    slow_rank: Optional[int] = non_negative(None)
    slow_seconds: float = non_negative(0.5)
    # SIGTERM, SIGINT or SIGHUP to `parakit train`: finish the step, save it, then stop (Megatron-LM's
    # --exit-signal-handler); a second signal stops at once. false: every rank stops at once.
    save_on_stop: bool = False


@dataclass
class TrainConfig:
    global_batch: int = at_least_one(16)  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = at_least_one(1)  # sequences per rank per forward/backward
    grad_accum: Optional[int] = at_least_one(None)  # derived: global_batch / (micro_batch * dp)
    steps: Optional[int] = at_least_one(50)  # optimizer steps (or give tokens)
    tokens: Optional[int] = at_least_one(None)  # total training tokens; sets steps when steps is null
    # Stop after this many steps while the learning-rate schedule still spans train.steps (a short
    # look at a long run, as Megatron-LM's --exit-interval): saved at the stop when checkpointing.
    stop_after_steps: Optional[int] = at_least_one(None)
    seed: int = _bounded(  # numpy's and torch's seeds are unsigned 32-bit
        1234, Bounds("a seed lies in 0..4294967295 (2**32 - 1)", "set {path} in 0..4294967295", min=0, max=2**32 - 1)
    )
    log_interval: int = at_least_one(1)
    # Validation loss every N steps (and after the last) on the validation part of data.split:
    # the same eval_iters global batches each time, so that the values compare. null: none.
    eval_interval: Optional[int] = at_least_one(None)
    eval_iters: int = at_least_one(10)
    # flash: fused attention kernels that store no s^2 scores (FlashAttention, cuDNN);
    # unfused: QK^T, softmax and AV as separate kernels (pre-2023 Megatron, eager PyTorch on CPU).
    attention_backend: AttentionBackend = AttentionBackend.flash
    # The layers' element-wise work and the loss: fused kernels (megatron-core's bias-activation,
    # bias-dropout and cross-entropy fusions; Liger's RMSNorm, RoPE, SwiGLU and fused linear
    # cross-entropy for the deepspeed backend's transformers models, package liger-kernel) or the
    # reference PyTorch operations; auto: fused on GPUs, reference on CPU.
    kernels: KernelChoice = KernelChoice.auto
    # Start from these model weights (a megatron-core dist checkpoint, any layout: resharded on load).
    init_checkpoint: Optional[str] = path_text(None)
    # Save the initial weights there before the first step (to start other layouts from them).
    save_init_checkpoint: Optional[str] = path_text(None)
    # CPU: record each rank's peak bytes held by tensors (torch.profiler's memory events over
    # start-up and the first two steps, which it slows); sweeps turn it on. GPUs always record
    # the allocator's peak.
    profile_memory: bool = False
    # GPUs: the caching allocator's last N allocations and frees (with Python stacks) are kept, and a
    # rank that runs out of memory dumps them into <run dir>/oom/ beside the planner's terms
    # (toolkit.train.oom). 0: nothing recorded.
    oom_history: int = non_negative(100_000)
    # torch.profiler over steps profile_step_start to profile_step_end (exclusive; null: one step) on
    # rank 0, as Megatron-LM's --profile-step-start/--profile-step-end: <run dir>/profile/ gets a
    # Chrome trace and each step's summary (on a GPU: kernel time by kind, and how long the device
    # waited for the host). null: no profile.
    profile_step_start: Optional[int] = at_least_one(None)
    profile_step_end: Optional[int] = at_least_one(None)
    # Where the scalars go besides the console (toolkit.train.trackers): the same ones everywhere (loss,
    # lr, grad norm, tokens/s, MFU, memory, validation, the planner's predictions), with the resolved
    # config as the run's parameters; a resumed run is a new tracker run in the same group.
    loggers: list[Logger] = field(default_factory=lambda: [Logger.jsonl, Logger.tensorboard])
    tracker_project: str = a_name("parakit")  # the W&B project and the MLflow experiment
    wandb_entity: Optional[str] = a_name(None)  # the W&B team or user; null: the account's default
    # offline: into <run dir>/wandb/, uploaded later by `wandb sync`; online: to the W&B server
    wandb_mode: WandbMode = WandbMode.offline
    # null: $MLFLOW_TRACKING_URI if set, else sqlite:///<run dir>/mlflow.db (`mlflow ui --backend-store-uri` it)
    mlflow_tracking_uri: Optional[str] = _bounded(
        None,
        Bounds(
            "must be an MLflow tracking URI (not empty) on one line (http://HOST:5000, sqlite:///PATH, databricks)",
            "give {path} a tracking URI without newlines or control characters, or null",
            pattern=r"[^\x00-\x1f\x7f]+",
            rule="uri",
        ),
    )
    fault: FaultConfig = field(default_factory=FaultConfig)


@dataclass
class StackCosts:
    """What one backend's software stack costs on a cluster beside the work the planner models
    (operator dispatch, Python, the loss's own kernels), measured by `parakit probe` on one rank."""

    # per layer and micro-batch, forward and backward; on a GPU host work, which kernels that take
    # longer hide (fitted where a tiny layer waits on the host)
    layer_s: float = non_negative(0.0)
    loss_s_per_logit: float = non_negative(0.0)  # the loss, forward and backward, per logit (token x vocab entry)
    step_s: float = non_negative(0.0)  # per optimizer step (optimizer launch, bookkeeping)
    tp_layer_s: float = non_negative(0.0)  # added per layer and micro-batch under tensor parallel (its mappings)


@dataclass
class SlurmConfig:
    """What a multi-node launch.sh asks Slurm for (sbatch's options of the same names)."""

    partition: Optional[str] = slurm_name(None, several=True)  # null: the cluster's default partition
    account: Optional[str] = slurm_name(None)
    qos: Optional[str] = slurm_name(None)
    # the job's time limit as sbatch takes it (HH:MM:SS, D-HH:MM:SS); null: the partition's
    time: Optional[str] = slurm_time(None)
    constraint: Optional[str] = sbatch_value(None)  # node features (--constraint)
    exclusive: bool = True  # whole nodes: no other job shares their devices or network
    # CPUs for each node's one task (torchrun and its ranks); null: one per rank on CPU clusters,
    # Slurm's default on GPU clusters.
    cpus_per_task: Optional[int] = at_least_one(None)
    extra_sbatch: list[str] = field(default_factory=list, metadata={"bounds": SBATCH_VALUE})  # e.g. ["--mail-type=END"]
    container_image: Optional[str] = path_text(None)  # pyxis/enroot: srun --container-image
    container_mounts: Optional[str] = path_text(None)  # pyxis/enroot: srun --container-mounts (SRC:DST,...)
    # The network interface NCCL and gloo use between nodes (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME);
    # null: their own choice.
    socket_ifname: Optional[str] = _bounded(
        None,
        Bounds(
            "must be interface names as NCCL_SOCKET_IFNAME takes them (eth0, ib0,eth1, ^docker,lo or =eth0)",
            "set {path} to an interface name (ip link lists them), or null",
            pattern=r"[\^=]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*",
            rule="ifname",
        ),
    )
    log_dir: Optional[str] = sbatch_value(None)  # the job's log and one log per node; null: <run directory>/logs
    # Preemption: Slurm signals the batch script this many seconds before the time limit
    # (--signal=B:USR1@S); the ranks stop after their step with a checkpoint and the job requeues
    # itself (toolkit.train.preemption). null: no signal.
    signal_before_s: Optional[int] = at_least_one(300)
    requeue: bool = True  # --requeue: Slurm may requeue the job, and it requeues itself when preempted


@dataclass
class ClusterConfig:
    name: str = a_name("cpu")
    device: Device = Device.cpu
    gpu: str = one_line("cpu")  # accelerator model, for reports
    # The precision when none is given (conf/precision/auto.yaml): bf16 where the accelerator has
    # it, fp32 on CPU and on GPUs before bf16 (V100).
    default_dtype: Dtype = Dtype.fp32
    nodes: int = at_least_one(1)
    gpus_per_node: int = at_least_one(4)  # on CPU: processes per node
    gpu_memory_gb: Optional[float] = hardware(None)
    # Dense peak throughput per device, TFLOP/s (vendor datasheet, no sparsity).
    peak_tflops_bf16: Optional[float] = peak_or_zero(None)
    peak_tflops_fp16: float = non_negative(0.0)  # 0: none
    peak_tflops_fp32: Optional[float] = hardware(None)
    peak_tflops_fp8: float = non_negative(0.0)  # 0: none
    # Bandwidth per device, GB/s in one direction.
    intra_node_bandwidth_gbs: Optional[float] = hardware(None)
    inter_node_bandwidth_gbs: Optional[float] = hardware(None)
    # Latency of one step of a ring collective (the alpha of the alpha-beta model): NCCL's
    # all-reduce of a small message takes ~20 us on 8 GPUs, 14 ring steps (nccl-tests).
    collective_latency_s: float = non_negative(1.5e-6)
    # Point-to-point sends (pipeline activations): latency, and bandwidth (null: the link's).
    p2p_latency_s: float = non_negative(20e-6)
    p2p_bandwidth_gbs: Optional[float] = positive_or_null(None)
    # Device memory bandwidth that memory-bound work reaches (STREAM's triad, measured; the
    # datasheet figure is the pins' rate, 83-89% of which a kernel streams on A100-H200).
    hbm_bandwidth_gbs: Optional[float] = hardware(None)
    # How fast a new large tensor is first written where the allocator maps fresh pages for it
    # (CPU: glibc maps tensors over 32 MiB afresh, and each page faults in); null: allocations
    # reuse memory (the GPU caching allocator).
    fresh_memory_gbs: Optional[float] = positive_or_null(None)
    # Fraction of peak a large, well-shaped GEMM sustains in training (a matmul benchmark that holds
    # the GPU at its power limit, below the boost clock a short burst reaches).
    gemm_efficiency: float = fraction(0.8)
    # How far the sustained GEMM rate of the GPUs of one node spreads, fastest to slowest, as a
    # fraction of it: chips of one model differ, and a synchronous step waits on the slowest GPU
    # of the whole job (toolkit.plan.kernels.slowest_chip_factor). 0: identical chips.
    gemm_chip_spread: float = _bounded(
        0.0,
        Bounds("is a fraction of the GEMM rate: it lies in [0, 1)", "set {path} in [0, 1), e.g. 0.05", min=0, below=1),
    )
    # A GEMM dimension at which a kernel reaches half its large-shape efficiency (the saturation
    # curve `parakit probe` fits on CPU; on GPUs it shapes only flash attention's head dimension
    # and block, their GEMMs follow tile and wave quantization instead, see sm_count).
    gemm_half_size: float = non_negative(128.0)
    # Streaming multiprocessors of one GPU (NVIDIA whitepapers: V100 80, A100 108, H100/H200 SXM
    # 132): a GEMM's output tiles run in waves of this many (toolkit.plan.kernels.wave_efficiency).
    # null (CPU): GEMMs follow the gemm_half_size saturation curve.
    sm_count: Optional[int] = at_least_one(None)
    # Whether the training machines have Transformer Engine (or apex): megatron-core then steps its
    # FusedAdam; without, torch's AdamW in its default multi-tensor (foreach) form. `parakit probe`
    # records it.
    transformer_engine: bool = True
    # Host seconds to issue one eager PyTorch operation to the device (Python, the dispatcher and
    # autograd, the kernel launch: about 5-25 us, J. Lin, "From PyTorch op to kernel launch"). A
    # kernel that runs shorter than this waits on the host (toolkit.plan.kernels.dispatched_time);
    # `parakit probe` measures it.
    op_dispatch_s: float = non_negative(10e-6)
    # Host seconds DeepSpeed ZeRO-3 spends on one module's parameter fetch or release (its hooks and
    # partitioned-parameter coordinator: trace, all-gather launch and wait, release), four per module
    # and micro-batch, during which the device waits. parakit's tiny model (75 modules) on one CPU
    # rank, DeepSpeed 0.19.8: ZeRO-3 took 0.39 s more than ZeRO-1 per 4 micro-batches, 326 us per
    # fetch or release; `parakit probe` measures it.
    zero3_module_s: float = non_negative(326e-6)
    # Fixed time every optimizer step costs beside its modelled work (framework and Python
    # dispatch, kernel launches, synchronisation): 0 for a datasheet cluster, fitted by
    # `parakit calibrate` from a measured sweep.
    step_overhead_s: float = non_negative(0.0)
    # Time each layer costs per micro-batch beside its modelled work (operator dispatch and kernel
    # launches, forward and backward): what bounds small layers; 0 for a datasheet cluster, fitted
    # by `parakit calibrate`.
    layer_overhead_s: float = non_negative(0.0)
    # CPU clusters: the cores one node's ranks share (one thread per rank); more ranks than cores
    # time-share them. null: this machine's core count.
    cores_per_node: Optional[int] = at_least_one(None)
    # backend name -> its stack's costs; none: the planner's work model alone (datasheet clusters)
    stack: dict[str, StackCosts] = field(default_factory=dict)
    gpu_mtbf_hours: float = positive(50_000.0)  # mean time between failures of one device
    checkpoint_write_gbs_per_node: float = positive(2.0)  # sustained checkpoint write bandwidth per node
    # One GPU's copies to host memory (an asynchronous save's snapshot holds training this long):
    # the host link's sustained rate; null: hbm_bandwidth_gbs (CPU ranks copy within memory).
    host_link_gbs: Optional[float] = positive_or_null(None)
    # The network: inter_node_bandwidth_gbs is one NIC's line rate (one GPU's port on a rail-optimised
    # fabric), and a node has nics_per_node of them (null: one per GPU). NCCL runs a ring over nodes
    # with a channel per NIC, so a group with r ranks on each node crosses over r GPUs' share of the
    # node's NICs (toolkit.plan.collectives.bus_gbs).
    nics_per_node: Optional[int] = at_least_one(None)
    # NVLink SHARP (NVSwitch reduces all-reduces inside the node: HGX H100/H200, NCCL >= 2.17) and
    # InfiniBand SHARP (the switches reduce across nodes: NCCL's CollNet with the SHARP plugin): count
    # only where the cluster has and enables them.
    nvls: bool = False
    sharp: bool = False
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # multi-node runs: what sbatch asks for


@dataclass
class BackendConfig:
    name: BackendName = BackendName.megatron


@dataclass
class DataConfig:
    name: DataName = DataName.corpus
    # A prefix made by `parakit data prepare` (its manifest names the tokenizer and vocabulary), or
    # a blend "W1 PREFIX1 W2 PREFIX2 ..." as Megatron-LM's --data-path; null: the bundled corpus.
    path: Optional[str] = path_text(None)
    tokenizer: Tokenizer = Tokenizer.gpt2  # for a prefix without a manifest
    split: str = one_line("98,2,0")  # train,valid,test shares of the documents (Megatron-LM's --split)
    # DataLoader processes per rank making micro-batches ahead of the step; null: 2 on GPUs, 0 on CPU.
    num_workers: Optional[int] = non_negative(None)


class CheckpointVerify(StrEnum):
    """What a checkpoint's manifest records per file beside its size, and what a resume checks."""

    xxh3 = "xxh3"  # accidental damage (XXH3-128), at near the disk's read speed (the default)
    # accidental damage, at about a quarter of xxh3's speed; no more than xxh3 against a deliberate
    # change: whoever can rewrite the files can rewrite the manifest beside them
    sha256 = "sha256"
    crc32 = "crc32"  # accidental damage, at about half of xxh3's speed
    size = "size"  # sizes only: reads nothing, catches truncated and missing files


@dataclass
class CheckpointConfig:
    dir: Optional[str] = path_text(None)  # default: <run directory>/checkpoints
    interval_steps: Optional[int] = at_least_one(None)  # save every N steps
    interval_minutes: Optional[float] = positive_or_null(None)  # or every N minutes of wall time
    # or the planner's rule (Daly's interval, capped by the rework bound) with the measured save time
    auto_interval: bool = False
    # the checkpoints published last that pruning keeps (in publication order); the one this run
    # resumed from and the one just published are kept as well
    keep_last: int = at_least_one(3)
    # megatron backend: write the shards from a forked process while training goes on
    # (megatron-core's asynchronous dist_checkpointing save); published when the writes are done.
    # null: on GPUs (the snapshot is a copy to host memory, then training goes on), not on CPU
    # (the writer competes with the ranks for the same cores) nor on the deepspeed backend.
    async_save: Optional[bool] = None
    # megatron backend: save the distributed optimizer in model space, gathered over each data-parallel
    # group (slower, more memory), so that any tp/pp/vpp/cp/ep resumes it directly; false: each rank
    # writes its own shards, resumable at any dp (parakit train converts it once for another layout).
    reshardable: bool = False
    resume: bool = True  # continue from the newest good checkpoint in `dir`
    # Per file: xxh3 | sha256 | crc32 | size (toolkit.train.checkpoint); every rank checksums its share,
    # at a resume before anything reads it (size: nothing is verified before the engines unpickle).
    verify: CheckpointVerify = CheckpointVerify.xxh3
    # For the planner's interval rule: the rework one failure may cost at most, and the
    # measured time of one save (estimated from checkpoint size and bandwidth when null).
    acceptable_rework_minutes: float = positive(30.0)
    save_seconds: Optional[float] = positive_or_null(None)


class MemoryCheck(StrEnum):
    """What the validator does when the predicted peak memory exceeds the device."""

    error = "error"
    warn = "warn"
    off = "off"


@dataclass
class ChecksConfig:
    """Thresholds of the validator's warnings."""

    memory: MemoryCheck = MemoryCheck.error  # a layout predicted not to fit in cluster.gpu_memory_gb

    max_bubble_fraction: float = _bounded(
        0.25, Bounds("is a fraction of the step: it lies in [0, 1]", "set {path} in [0, 1], e.g. 0.25", min=0, max=1)
    )  # warn when (pp-1)/(vpp*m) exceeds this
    min_microbatches_per_stage: int = at_least_one(4)  # warn when micro-batches < this * pp


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    description: str = one_line("")  # a recipe says what it is for
