"""The typed schema every parakit configuration is composed into.

Plain dataclasses, no Hydra import: `toolkit.plan` reads these objects without pulling in
Hydra or torch. `toolkit.config.store` registers them in Hydra's ConfigStore so that a wrong
type (`parallel.tp=abc`) or an unknown key fails at composition.

Names follow what users of Megatron-LM and DeepSpeed type: `parallel.tp`, `parallel.pp`,
`parallel.vpp`, `zero=0..3`, `precision=bf16`, `recompute=full`, `train.global_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelConfig:
    """A decoder-only transformer, described once for every consumer (planner, Megatron, HF)."""

    name: str = "tiny"
    family: str = "llama"  # llama | qwen2 | mistral | gpt2: the Hugging Face architecture it maps to
    sliding_window: Optional[int] = None  # mistral: attend to the last N tokens only
    num_layers: int = 8
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_kv_heads: Optional[int] = None  # None: multi-head attention (kv heads = heads)
    head_dim: Optional[int] = None  # None: hidden_size / num_attention_heads
    ffn_hidden_size: int = 256
    vocab_size: int = 50257
    # Megatron pads the embedding to a multiple of this times tp (--make-vocab-size-divisible-by).
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 128  # training sequence length
    max_position_embeddings: int = 128  # the longest sequence the model supports
    normalization: str = "RMSNorm"  # RMSNorm | LayerNorm
    norm_epsilon: float = 1e-5
    activation: str = "swiglu"  # swiglu | gelu
    position_embedding: str = "rope"  # rope | learned_absolute
    rotary_base: float = 10000.0
    tie_embeddings: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # A local Hugging Face model directory (config.json + safetensors) to start from on the
    # deepspeed backend; its architecture must match the fields above.
    hf_path: Optional[str] = None


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: int = 1  # virtual pipeline stages per pipeline rank (interleaved 1F1B when > 1)
    dp: Optional[int] = None  # data parallel size; derived from the world size when left out
    cp: int = 1  # context parallel size (megatron backend)
    # Uneven pipeline: layers on the first / last stage (the rest split evenly over the middle
    # stages), e.g. Llama 3 405B's 126 layers on 16 stages as 7 + 14 x 8 + 7.
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    sequence_parallel: bool = False  # Megatron sequence parallel (needs tp > 1)


@dataclass
class ZeroConfig:
    """ZeRO stage. On the megatron backend stage 1 is Megatron's distributed optimizer."""

    stage: int = 1
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (stage 3 only)
    nvme_path: Optional[str] = None
    overlap_comm: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000


@dataclass
class PrecisionConfig:
    dtype: str = "bf16"  # fp32 | bf16 | fp16 | fp8
    # fp16 needs loss scaling: dynamic (recommended), static (loss_scale), or none.
    loss_scaling: str = "dynamic"
    loss_scale: float = 1.0  # static scale, used when loss_scaling=static
    initial_scale_power: int = 16  # dynamic: start at 2**power
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    fp8_format: str = "hybrid"  # hybrid | e4m3 (Transformer Engine recipes)
    grad_reduce_in_fp32: bool = True


@dataclass
class RecomputeConfig:
    granularity: str = "none"  # none | selective | full
    method: str = "uniform"  # full only: uniform | block (Megatron --recompute-method)
    num_layers: int = 1  # full only: layers per recompute chunk (uniform) or per stage (block)
    modules: list[str] = field(default_factory=lambda: ["core_attn"])  # selective only


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    min_lr: float = 3e-5
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    warmup_steps: int = 100
    decay_style: str = "cosine"  # cosine | linear | constant
    decay_steps: Optional[int] = None  # None: decay over all training steps
    # Rescaling rule when the global batch differs from the batch lr/warmup were tuned at.
    lr_scaling: str = "none"  # none | linear | sqrt
    reference_global_batch: Optional[int] = None


@dataclass
class FaultConfig:
    """Fault handling, and fault injection for tests and drills (injections act on the first
    attempt only, so that a restarted job runs through)."""

    max_restarts: int = (
        0  # torchrun restarts the ranks this often; each restart resumes from the newest good checkpoint
    )
    watchdog_timeout_s: Optional[float] = None  # end the job when a rank makes no progress this long
    nan_action: str = "stop"  # on a non-finite loss: skip (the update) | stop (keep the last good checkpoint)
    kill_rank: Optional[int] = None  # this rank dies ...
    kill_at_step: Optional[int] = None  # ... at the start of this step
    stall_rank: Optional[int] = None  # this rank hangs ...
    stall_at_step: Optional[int] = None  # ... at the start of this step ...
    stall_seconds: float = 3600.0  # ... for this long
    nan_at_step: Optional[int] = None  # the loss of this step becomes NaN
    crash_in_save_at_step: Optional[int] = None  # rank 0 dies after writing, before publishing, this save
    corrupt_checkpoint_at_step: Optional[int] = None  # the checkpoint of this step is damaged after publishing


@dataclass
class TrainConfig:
    global_batch: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = 1  # sequences per rank per forward/backward
    grad_accum: Optional[int] = None  # derived: global_batch / (micro_batch * dp)
    steps: Optional[int] = 50  # optimizer steps (or give tokens)
    tokens: Optional[int] = None  # total training tokens; sets steps when steps is null
    seed: int = 1234
    log_interval: int = 1
    # flash: fused attention kernels that store no s^2 scores (FlashAttention, cuDNN);
    # unfused: QK^T, softmax and AV as separate kernels (pre-2023 Megatron, eager PyTorch on CPU).
    attention_backend: str = "flash"
    # Start from these model weights (a megatron-core dist checkpoint, any layout: resharded on load).
    init_checkpoint: Optional[str] = None
    # Save the initial weights there before the first step (to start other layouts from them).
    save_init_checkpoint: Optional[str] = None
    fault: FaultConfig = field(default_factory=FaultConfig)


@dataclass
class ClusterConfig:
    name: str = "cpu"
    device: str = "cpu"  # cuda | cpu
    gpu: str = "cpu"  # accelerator model, for reports
    nodes: int = 1
    gpus_per_node: int = 4  # on CPU: processes per node
    gpu_memory_gb: float = 4.0
    # Dense peak throughput per device, TFLOP/s (vendor datasheet, no sparsity).
    peak_tflops_bf16: float = 0.5
    peak_tflops_fp16: float = 0.0
    peak_tflops_fp32: float = 0.5
    peak_tflops_fp8: float = 0.0
    # Bandwidth per device, GB/s in one direction.
    intra_node_bandwidth_gbs: float = 10.0
    inter_node_bandwidth_gbs: float = 1.0
    hbm_bandwidth_gbs: float = 20.0  # device memory bandwidth (memory-bound ops)
    # Fraction of peak a large, well-shaped GEMM reaches (a measured matmul benchmark).
    gemm_efficiency: float = 0.8
    gpu_mtbf_hours: float = 50_000.0  # mean time between failures of one device
    checkpoint_write_gbs_per_node: float = 2.0  # sustained checkpoint write bandwidth per node


@dataclass
class BackendConfig:
    name: str = "megatron"  # megatron | deepspeed


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic | corpus
    path: Optional[str] = None  # Megatron indexed dataset prefix (corpus)
    tokenizer: str = "gpt2"
    split: str = "98,2,0"
    num_workers: int = 1


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # default: <run directory>/checkpoints
    interval_steps: Optional[int] = None  # save every N steps
    interval_minutes: Optional[float] = None  # or every N minutes of wall time
    # or the planner's rule (Daly's interval, capped by the rework bound) with the measured save time
    auto_interval: bool = False
    keep_last: int = 3
    # megatron backend: write the shards from a forked process while training goes on
    # (megatron-core's asynchronous dist_checkpointing save); published when the writes are done.
    async_save: bool = False
    resume: bool = True  # continue from the newest good checkpoint in `dir`
    # For the planner's interval rule: the rework one failure may cost at most, and the
    # measured time of one save (estimated from checkpoint size and bandwidth when null).
    acceptable_rework_minutes: float = 30.0
    save_seconds: Optional[float] = None


@dataclass
class ChecksConfig:
    """Thresholds of the validator's warnings."""

    max_bubble_fraction: float = 0.25  # warn when (pp-1)/(vpp*m) exceeds this
    min_microbatches_per_stage: int = 4  # warn when micro-batches < this * pp


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    description: str = ""  # a recipe says what it is for
