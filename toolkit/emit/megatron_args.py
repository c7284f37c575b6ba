"""The equivalent Megatron-LM `pretrain_gpt.py` command line.

Flag names as defined in Megatron-LM `megatron/training/arguments.py` (core_r0.15 and later).
Built from the same sections as megatron.yaml, so the two cannot disagree.
"""

from __future__ import annotations

from toolkit.config.schema import Config
from toolkit.formats.manifest import parse_blend, read_manifest, tokenizer_dir
from toolkit.plan.layout import Layout


def megatron_args(cfg: Config, layout: Layout, sections: dict) -> list[str]:
    """Megatron-LM's pretrain_gpt.py command-line flags for the same run (megatron_args.txt), built
    from the sections megatron.yaml holds, so both files say the same; one flag (with its value) per
    entry, in pretrain_gpt.py's order of concerns."""
    mp, tr, opt, ddp, sch, gpt = (
        sections[k] for k in ("model_parallel", "transformer", "optimizer", "ddp", "scheduler", "gpt_model")
    )
    m = cfg.model
    args: list[str] = [
        # model
        f"--num-layers {tr['num_layers']}",
        f"--hidden-size {tr['hidden_size']}",
        f"--num-attention-heads {tr['num_attention_heads']}",
        f"--ffn-hidden-size {tr['ffn_hidden_size']}",
        f"--kv-channels {tr['kv_channels']}",
        f"--seq-length {layout.seq_length}",
        f"--max-position-embeddings {m.max_position_embeddings}",
        f"--position-embedding-type {gpt['position_embedding_type']}",
        f"--normalization {tr['normalization']}",
        f"--norm-epsilon {tr['layernorm_epsilon']}",
        f"--init-method-std {tr['init_method_std']}",
        f"--hidden-dropout {tr['hidden_dropout']}",
        f"--attention-dropout {tr['attention_dropout']}",
        "--attention-softmax-in-fp32",
    ]
    if tr["num_query_groups"] != tr["num_attention_heads"]:
        args += ["--group-query-attention", f"--num-query-groups {tr['num_query_groups']}"]
    if gpt["position_embedding_type"] == "rope":
        args.append(f"--rotary-base {int(gpt['rotary_base'])}")
    if gpt["rope_scaling"]:  # Llama 3.1's scaling; pretrain_gpt.py passes both to GPTModel
        args += ["--use-rope-scaling", f"--rope-scaling-factor {gpt['rope_scaling_factor']}"]
    if tr["gated_linear_unit"]:
        args.append("--swiglu")
    if tr["activation_func"] == "gelu_tanh":
        args.append("--openai-gelu")
    if tr["window_size"]:
        args.append(f"--window-size {tr['window_size'][0]},{tr['window_size'][1]}")
    if not tr["add_bias_linear"]:
        args.append("--disable-bias-linear")
    if tr["add_qkv_bias"] and not tr["add_bias_linear"]:
        args.append("--add-qkv-bias")
    if not gpt["share_embeddings_and_output_weights"]:
        args.append("--untie-embeddings-and-output-weights")
    # Megatron-LM pads the tokenizer's vocabulary itself: pass the unpadded size. A prepared
    # dataset carries its tokenizer's files (PREFIX.tokenizer): Megatron-LM reads them, so that
    # its end-of-document id is the one the documents end with.
    args.append(f"--make-vocab-size-divisible-by {max(1, m.make_vocab_size_divisible_by)}")
    prefix = parse_blend(cfg.data.path)[0][0] if cfg.data.name == "corpus" and cfg.data.path else None
    if prefix and read_manifest(prefix):
        args += ["--tokenizer-type HuggingFaceTokenizer", f"--tokenizer-model {tokenizer_dir(prefix)}"]
    else:
        args += ["--tokenizer-type NullTokenizer", f"--vocab-size {m.vocab_size}"]

    # parallel layout
    args += [f"--tensor-model-parallel-size {layout.tp}", f"--pipeline-model-parallel-size {layout.pp}"]
    if layout.vpp > 1:
        args.append(f"--num-virtual-stages-per-pipeline-rank {layout.vpp}")
        if not mp["overlap_p2p_comm"]:  # Megatron-LM overlaps the interleaved sends by default
            args.append("--no-overlap-p2p-communication")
    if tr["num_layers_in_first_pipeline_stage"] is not None:
        args.append(f"--decoder-first-pipeline-num-layers {tr['num_layers_in_first_pipeline_stage']}")
    if tr["num_layers_in_last_pipeline_stage"] is not None:
        args.append(f"--decoder-last-pipeline-num-layers {tr['num_layers_in_last_pipeline_stage']}")
    if layout.cp > 1:
        args += [f"--context-parallel-size {layout.cp}", f"--cp-comm-type {tr['cp_comm_type']}"]
    if mp["sequence_parallel"]:
        args.append("--sequence-parallel")
    if mp["tp_comm_overlap"]:
        args.append("--tp-comm-overlap")
    if opt["use_distributed_optimizer"]:
        args.append("--use-distributed-optimizer")
    if ddp["overlap_grad_reduce"]:
        args.append("--overlap-grad-reduce")
    if ddp["overlap_param_gather"]:
        args.append("--overlap-param-gather")
    if ddp["num_distributed_optimizer_instances"] > 1:
        args.append(f"--num-distributed-optimizer-instances {ddp['num_distributed_optimizer_instances']}")
    if ddp["bucket_size"] is not None:
        args.append(f"--ddp-bucket-size {ddp['bucket_size']}")
    if not mp["gradient_accumulation_fusion"]:
        args.append("--no-gradient-accumulation-fusion")
    if cfg.cluster.device == "cpu":
        args += ["--use-cpu-initialization", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion"]
        args.append("--no-bias-swiglu-fusion" if tr["gated_linear_unit"] else "--no-bias-gelu-fusion")
    args.append(f"--transformer-impl {tr['transformer_impl']}")
    args.append(f"--attention-backend {tr['attention_backend']}")

    # batch and schedule
    args += [
        f"--micro-batch-size {layout.micro_batch}",
        f"--global-batch-size {layout.global_batch}",
        f"--train-iters {layout.steps}",
        f"--lr {opt['lr']}",
        f"--min-lr {opt['min_lr']}",
        f"--lr-decay-style {sch['lr_decay_style']}",
        f"--lr-warmup-iters {sch['lr_warmup_steps']}",
        f"--lr-decay-iters {sch['lr_decay_steps']}",
        f"--weight-decay {opt['weight_decay']}",
        f"--adam-beta1 {opt['adam_beta1']}",
        f"--adam-beta2 {opt['adam_beta2']}",
        f"--adam-eps {opt['adam_eps']}",
        f"--clip-grad {opt['clip_grad']}",
    ]

    # precision
    if mp["bf16"]:
        args.append("--bf16")
    if mp["fp16"]:
        args.append("--fp16")
        if opt["loss_scale"] is not None:
            args.append(f"--loss-scale {opt['loss_scale']}")
        else:
            args += [
                f"--initial-loss-scale {int(opt['initial_loss_scale'])}",
                f"--min-loss-scale {opt['min_loss_scale']}",
                f"--loss-scale-window {int(opt['loss_scale_window'])}",
                f"--hysteresis {opt['hysteresis']}",
            ]
    if tr["fp8"]:
        args.append(f"--fp8-format {tr['fp8']}")
    if ddp["grad_reduce_in_fp32"] and (mp["bf16"] or mp["fp16"]):
        args.append("--accumulate-allreduce-grads-in-fp32")

    # activation recompute
    if tr["recompute_granularity"]:
        args.append(f"--recompute-granularity {tr['recompute_granularity']}")
    if tr["recompute_granularity"] == "full":
        args += [f"--recompute-method {tr['recompute_method']}", f"--recompute-num-layers {tr['recompute_num_layers']}"]
    if tr["recompute_granularity"] == "selective" and tr["recompute_modules"] != ["core_attn"]:
        args.append("--recompute-modules " + " ".join(tr["recompute_modules"]))

    # data and logging
    if cfg.data.name == "corpus" and cfg.data.path:
        args += [f"--data-path {cfg.data.path}", f"--split {cfg.data.split}"]
    else:
        args.append("--mock-data")
    args.append(f"--num-workers {layout.loader_workers}")
    if cfg.train.eval_interval:
        args += [f"--eval-interval {cfg.train.eval_interval}", f"--eval-iters {cfg.train.eval_iters}"]
    else:
        args.append("--eval-iters 0")  # Megatron-LM would otherwise evaluate every 1000 steps
    args += [f"--seed {cfg.train.seed}", f"--log-interval {cfg.train.log_interval}"]
    return args
