"""The megatron backend: megatron-core GPTModel + DDP (+ distributed optimizer), trained with
get_forward_backward_func (1F1B, interleaved 1F1B when vpp > 1) from the resolved layout.

Runs on NVIDIA GPUs with NCCL, and on CPU with gloo through toolkit.train.mcore_cpu.
"""

from __future__ import annotations

import contextlib
import shutil
from functools import partial
from pathlib import Path

import torch

from toolkit.config.schema import Config
from toolkit.emit.megatron import megatron_degrees, megatron_sections
from toolkit.formats.atomic import publish_directory
from toolkit.plan.backends import backend_named
from toolkit.plan.checkpoint import saves_asynchronously
from toolkit.plan.layout import Layout
from toolkit.train import checkpoint as ckpt
from toolkit.train import mcore_cpu, torch_adam
from toolkit.train.data import build_datasets, eval_batches, micro_batches
from toolkit.train.direct_reader import direct_reads
from toolkit.train.distributed import end_process_group, init_process_group
from toolkit.train.loop import Gradients, Update
from toolkit.train.megatron_configs import build_megatron_configs
from toolkit.train.probe import ComputeTimers

# The distributed optimizer's checkpoint formats (megatron-core optimizer/distrib_optimizer.py):
# "dp_reshardable" writes each rank's own buffer shards, no gather (Megatron-LM's default), and
# resumes at any dp but only at the tp/pp/vpp/cp/ep it was saved with; "fully_reshardable"
# gathers every buffer over the data-parallel group at each save and resumes at any layout
# (Megatron-LM's --dist-ckpt-optim-fully-reshardable). Checkpoints without a recorded format
# were written by parakit before it recorded one, always fully_reshardable.
PARALLEL, RESHARDABLE = "dp_reshardable", "fully_reshardable"
# torch.save's serialization of each tensor is CPU-bound: two writer threads per rank took a
# 3 GB save from 0.32 to 0.72 GB/s on a 2-core CPU machine (measured; no gain past the cores).
WRITER_THREADS = 2


def _init_distributed(layout: Layout) -> None:
    init_process_group()
    world = torch.distributed.get_world_size()
    if world != layout.world_size:
        raise RuntimeError(
            f"launched with {world} processes but the layout needs {layout.world_size} "
            "(cluster.nodes x cluster.gpus_per_node)"
        )


def prepare_megatron() -> None:
    """megatron-core ready to train here: its CPU compatibility layer where CUDA is absent, and the
    resume fixes for torch's Adam wherever megatron-core falls back to it (CPU or GPU)."""
    mcore_cpu.enable()
    if torch_adam.runs_torch_adam():
        torch_adam.install_resume_fixes()


def _seed(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ckpt.seed_host_rngs(seed)
    model_parallel_cuda_manual_seed(seed)


def _experts_apart(chunks: list) -> None:
    """Keep the routed experts' parameters in DDP's expert buffers at every ep, ep=1 included.
    megatron-core marks them so (allreduce=False) only from ep > 1 (tensor_parallel/layers.py), and
    then its optimizer is a chain of a dense and an expert optimizer whose checkpoint keys an ep=1
    run's single optimizer does not have: a run could not resume into another ep. At ep=1 the
    expert-data-parallel ranks are the dp x cp ranks, so the reduction is the same."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.experts." in name:
                param.allreduce = False


def _loss(loss_mask: torch.Tensor, tokens: torch.Tensor, poison: bool, output: torch.Tensor):
    """This rank's share of one micro-batch's mean token loss (the schedule divides by the number
    of micro-batches). With context parallel a rank holds part of every sequence: its token losses
    are divided by the whole micro-batch's `tokens`, so the cp ranks' shares add up to the mean;
    megatron-core's schedule multiplies by cp against DDP's gradient average over dp x cp
    (schedules.forward_step_calc_loss, the two-value loss function).
    `poison` (train.fault.nan_at_step) makes it NaN before the backward pass, as a numerical fault
    would: NaN gradients follow."""
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(output.float().reshape(-1) * mask) / tokens
    if poison:
        loss = loss * float("nan")
    return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place


def _cp_share(batch: dict) -> dict:
    """This context-parallel rank's two of the 2*cp load-balanced chunks of every sequence
    (megatron-core's split, which its RoPE and TE's attention expect)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    return get_batch_on_this_cp_rank(dict(batch), False, parallel_state.get_context_parallel_group())


def _forward_step(data_iterator, model, poison: bool = False):
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:  # a middle pipeline stage: activations come from the previous stage
        return model(None, None, None), partial(_loss, None, None, False)
    tokens = batch["loss_mask"].sum().float()  # the whole micro-batch's, before the cp split
    batch = _cp_share(batch)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"], tokens, poison)


def _local_grads_finite(model: list) -> bool:
    """Whether this rank's gradient buffers hold only finite numbers (after the data-parallel
    reduction: a NaN on any replica has reached the reduced gradients). One pass over the
    gradients, as megatron-core's check_for_nan_in_grad makes, but without raising on this rank
    alone: the caller agrees with every rank on what to do."""
    sums = [buffer.grad_data.sum() for chunk in model for buffer in chunk.buffers]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())  # one device sync


def _load_weights(chunks: list, path: str, level: str = ckpt.DEFAULT_LEVEL) -> None:
    """Load model weights saved at any layout (dist_checkpointing reshards), once every rank has
    verified its share of the sealed folder. All chunks in one call: their sharded tensors
    together cover every layer, which the loader validates."""
    from megatron.core import dist_checkpointing

    def load(directory: Path) -> dict:
        with direct_reads():
            return dist_checkpointing.load(
                {f"chunk{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}, str(directory)
            )

    loaded = ckpt.load_sealed(Path(path), level, load)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"chunk{i}"], strict=True)


def _save_weights(chunks: list, path: str, level: str, saved_by: dict) -> None:
    """Save model weights layout-free (sharded tensors carry global layer keys and offsets) into a
    staging folder beside `path`, sealed and published whole by rank 0. A restarted attempt finds
    it published and leaves it (`parakit train` refuses an existing folder before the ranks start)."""
    from megatron.core import dist_checkpointing

    target = Path(path)
    if (target / ckpt.MANIFEST).is_file():
        return
    staging = target.with_name(f".{target.name}.partial")
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save({f"chunk{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}, str(staging))
    if torch.distributed.get_rank() == 0:
        ckpt.seal(staging, saved_by, level)
        publish_directory(staging, target, synced_files=True)
    torch.distributed.barrier()


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {**ckpt.host_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    ckpt.set_host_rng_state(state)
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(chunks, optimizer, is_loading: bool, optimizer_format: str) -> dict:
    model_state = {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    metadata = {"distrib_optim_sharding_type": optimizer_format}
    return {**model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading, metadata=metadata)}


def _save_strategy():
    """Each rank writes its own shards, and the replicated ones (the weights, over data-parallel
    ranks) are spread over the ranks that hold them (Megatron-LM's --ckpt-fully-parallel-save).
    The load stays plain: its fully parallel form, which reads each replica once and exchanges
    it, took 4.1 s against 1.8 s on 4 CPU ranks (gloo; measured) and is off in Megatron-LM too."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    writer = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=WRITER_THREADS)
    return FullyParallelSaveStrategyWrapper(writer, parallel_state.get_data_parallel_group(with_context_parallel=True))


def model_parallel_layout(layout: Layout, cfg: Config) -> dict:
    """What a dp_reshardable checkpoint must be resumed with: every degree but dp."""
    return {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "cp": layout.cp, "ep": cfg.parallel.ep}


def save_checkpoint(
    root: Path,
    step: int,
    chunks,
    optimizer,
    scheduler,
    layout: Layout,
    keep_last: int,
    fault,
    async_queue=None,
    verify: str = "xxh3",
    optimizer_format: str = PARALLEL,
    model_parallel: dict | None = None,
    saved_by: dict | None = None,
    resumed_from: str | None = None,
) -> float:
    """A verified checkpoint of `step`; returns the seconds training was held up. With an
    `async_queue` (megatron-core's AsyncCallsQueue) the shards are written by a forked process
    (a snapshot of this moment) while training goes on, and the checkpoint is published when
    the queue finalizes the save on every rank."""
    from megatron.core import dist_checkpointing

    def write(staging: Path):
        (staging / "model_optim").mkdir(exist_ok=True)
        request = dist_checkpointing.save(
            _sharded_state(chunks, optimizer, False, optimizer_format),
            str(staging / "model_optim"),
            sharded_strategy=_save_strategy(),
            async_sharded_save=async_queue is not None,
            async_strategy="mcore",
        )
        if async_queue is None:
            return None

        def finish_later(publish):
            request.add_finalize_fn(publish)
            async_queue.schedule_async_request(request)

        return finish_later

    state = {
        "step": step,
        "consumed_samples": step * layout.global_batch,
        "scheduler": scheduler.state_dict(),
        "layout": {**(model_parallel or {}), "dp": layout.dp, "world": layout.world_size},
        "optimizer_format": optimizer_format,
        "model": saved_by,
    }
    return ckpt.save_collectively(root, step, keep_last, fault, write, state, _rng_state(), verify, resumed_from)


def load_checkpoint(
    root: Path, chunks, optimizer, scheduler, layout: Layout, verify: str = "xxh3", model_parallel: dict | None = None
) -> ckpt.Resume:
    """Resume from the newest good checkpoint under `root`: a fully_reshardable one at any layout,
    a dp_reshardable one at any dp of its model-parallel layout (`parakit train` converts it
    first for another: toolkit.train.megatron_reshard)."""
    from megatron.core import dist_checkpointing

    def load(directory: Path) -> tuple[dict, dict | None]:
        state = ckpt.trainer_state(directory)
        optimizer_format = state.get("optimizer_format", RESHARDABLE)
        moved = layout_change(state, model_parallel or {})
        if optimizer_format == PARALLEL and moved:
            raise ckpt.ResumeError(
                f"checkpoint {directory} holds the distributed optimizer in the dp_reshardable format, which resumes "
                f"only at the model-parallel layout it was saved with ({moved}). Fix: resume it once at that layout "
                "with checkpoint.reshardable=true and let it save, or start `parakit train` on one node, which "
                "converts it"
            )
        if torch_adam.runs_torch_adam():
            torch_adam.seed_states(optimizer)
        with direct_reads():
            loaded = dist_checkpointing.load(
                _sharded_state(chunks, optimizer, True, optimizer_format), str(directory / "model_optim")
            )
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"chunk{i}"], strict=True)
        with torch.no_grad():  # dp_reshardable copies into the fp32 parameters themselves when they are the master
            optimizer.load_state_dict(loaded["optimizer"])
        return state, ckpt.saved_rng_state(directory, state, layout.world_size)

    directory, loaded, unusable = ckpt.load_collectively(root, verify, load)
    if directory is None:
        return ckpt.Resume(unusable=unusable)
    state, rng = loaded
    # once, for the checkpoint kept: megatron's scheduler adds the loaded steps to its own
    scheduler.load_state_dict(state["scheduler"])
    if rng is not None:
        _set_rng_state(rng)
    if torch.distributed.get_rank() == 0:
        print(f"resumed from {directory} at step {state['step']}", flush=True)
    return ckpt.Resume(state["step"], str(directory), unusable)


def layout_change(state: dict, model_parallel: dict) -> str:
    """The model-parallel degrees a checkpoint (its trainer_state) was saved with that differ
    from `model_parallel`, as "tp 2 -> 1, ..."; "" when none does (a degree it did not record
    counts as 1)."""
    saved = state["layout"]
    changed = [f"{k} {saved.get(k, 1)} -> {v}" for k, v in model_parallel.items() if saved.get(k, 1) != v]
    return ", ".join(changed)


class MegatronSteps:
    """The megatron backend's side of toolkit.train.loop: GPTModel chunks under DDP, the
    (distributed) optimizer and its scheduler, get_forward_backward_func's schedule."""

    def __init__(self, cfg: Config, layout: Layout):
        prepare_megatron()
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module

        from toolkit.train.megatron_init import draw_layout_free
        from toolkit.train.megatron_model import build_model_chunks, initialize_tp_comm_overlap

        self.cfg, self.layout = cfg, layout
        _init_distributed(layout)
        parallel_state.initialize_model_parallel(
            **megatron_degrees(layout), num_distributed_optimizer_instances=cfg.comm.optimizer_instances
        )
        _seed(cfg.train.seed)
        sections = megatron_sections(cfg, layout)
        config, optimizer_config, ddp_config = build_megatron_configs(sections)
        if config.tp_comm_overlap:  # the validator allows it on CUDA with TE only
            initialize_tp_comm_overlap(config, layout.seq_length, layout.micro_batch)
        chunks = build_model_chunks(sections, config)
        if cfg.train.init_checkpoint:
            _load_weights(chunks, cfg.train.init_checkpoint, cfg.checkpoint.verify)
        elif cfg.model.hf_path:
            from toolkit.families.hf_weights import load_hf_into_chunks

            load_hf_into_chunks(chunks, cfg.model.hf_path, cfg.model)
        else:
            draw_layout_free(chunks, cfg.train.seed)
        if cfg.train.save_init_checkpoint:
            _save_weights(chunks, cfg.train.save_init_checkpoint, cfg.checkpoint.verify, ckpt.model_record(cfg))
        _experts_apart(chunks)
        if config.bf16 or config.fp16:
            chunks = [Float16Module(config, chunk) for chunk in chunks]
        self.chunks = chunks
        self.model = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
        config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
        self.compute = config.timers = ComputeTimers()  # the schedule times its compute with it
        self.optimizer = get_megatron_optimizer(optimizer_config, self.model)
        if config.fp16:
            config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = OptimizerParamScheduler(self.optimizer, **sections["scheduler"])
        self.config, self.ddp_config = config, ddp_config
        self.async_queue = AsyncCallsQueue() if saves_asynchronously(cfg) else None
        self.forward_backward_func = get_forward_backward_func()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.needs_data = parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
        self.reports_loss = (
            parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
        )
        self.iterators = None

    def load(self, root: Path) -> ckpt.Resume:
        verify, model_parallel = self.cfg.checkpoint.verify, model_parallel_layout(self.layout, self.cfg)
        return load_checkpoint(root, self.chunks, self.optimizer, self.scheduler, self.layout, verify, model_parallel)

    def begin_at(self, step: int) -> None:
        # The sampler is indexed by step: a resumed run reads exactly the samples it would have read.
        self.data = build_datasets(self.cfg, self.layout)
        self.iterators = [
            micro_batches(self.data.train, self.layout, self.dp_rank, start_step=step) if self.needs_data else None
            for _ in self.model
        ]

    def forward_backward(self, step: int, poison: bool, beat) -> Gradients:
        layout, model = self.layout, self.model
        poison = poison and self.dp_rank == 0

        def forward_step(data_iterator, model_chunk):
            beat(step)
            return _forward_step(data_iterator, model_chunk, poison)

        for chunk in model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._moe_losses(None)  # values an evaluation's forward passes left
        outputs = self.forward_backward_func(
            forward_step_func=forward_step,
            data_iterator=self.iterators if len(model) > 1 else self.iterators[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=layout.grad_accum,
            seq_length=layout.seq_length,
            micro_batch_size=layout.micro_batch,
            forward_only=False,
        )
        # Mean loss over micro-batches and data-parallel replicas (the cp ranks' shares add up),
        # and the number of ranks with non-finite gradients, in one collective. With fp16 the loss
        # scaler owns the gradient check (an overflow is routine there: the optimizer skips the step).
        local = torch.zeros((), device=self.device)
        if self.reports_loss and outputs:
            local = torch.stack([o["lm loss"] for o in outputs]).mean()
        grads_bad = 0.0 if self.config.fp16 or _local_grads_finite(model) else 1.0
        total = torch.stack([local.float(), torch.tensor(grads_bad, device=local.device)])  # NCCL: on the GPU
        torch.distributed.all_reduce(total)
        finite = None if self.config.fp16 else total[1].item() == 0
        return Gradients(total[0].item() / layout.dp, finite, self._moe_losses(step))

    def _moe_losses(self, step: int | None) -> dict[str, float]:
        """The routers' load-balancing loss and z-loss of the step (unscaled by their coefficients),
        averaged over the MoE layers, micro-batches and data-parallel replicas, as Megatron-LM logs
        them (megatron-core moe_logging.MoEMetricsTracker.report, collective over every rank); then
        cleared. `step` None: only clear. {} for a dense model."""
        config = self.config
        if not config.num_moe_experts:
            return {}
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        tracker = get_moe_metrics_tracker()
        if step is None:
            tracker.clear()
            return {}
        # parakit's name -> the tracker's (router.py records the load-balancing loss by its type)
        balancing = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
        names = {}
        if recorded := balancing.get(config.moe_router_load_balancing_type):
            names["moe_aux_loss"] = recorded
        if config.moe_z_loss_coeff:
            names["moe_z_loss"] = "z_loss"
        totals: dict = {}
        tracker.report(
            loss_scale=1 / self.layout.grad_accum,
            iteration=step,
            num_layers=config.num_layers,
            moe_layer_freq=config.moe_layer_freq,
            force_initialize=True,  # pipeline ranks without MoE layers join the reduction
            track_names=list(names.values()),
            total_loss_dict=totals,
        )
        return {ours: float(totals[theirs]) for ours, theirs in names.items() if theirs in totals}

    def _sync_params(self) -> None:
        """With overlap_param_gather the distributed optimizer's all-gather of the updated weights
        runs inside the next forward (a pre-hook on every module): until then each rank holds only
        its own shard of them. Gather them now (Megatron-LM training.py force_param_sync, before
        every save)."""
        if self.ddp_config.overlap_param_gather:
            self.optimizer.prepare_model_params_for_param_sync()
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    @contextlib.contextmanager
    def _gathered_forward(self):
        """Forward passes outside training (evaluation) on gathered weights, with the all-gather
        pre-hooks off (Megatron-LM training.py: disable_forward_pre_hook around evaluate, which
        synchronises the parameters, then enable_forward_pre_hook)."""
        if not self.ddp_config.overlap_param_gather:
            yield
            return
        self.optimizer.prepare_model_params_for_param_sync()
        for chunk in self.model:
            chunk.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()

    def evaluate(self) -> float:
        """Forward only over the validation batches (Megatron-LM's evaluate: the same schedule with
        forward_only=True, the model in eval mode)."""
        with self._gathered_forward():
            return self._evaluate()

    def _evaluate(self) -> float:
        layout, model = self.layout, self.model
        iterators = [eval_batches(self.data.valid, layout, self.dp_rank) if self.needs_data else None for _ in model]
        for chunk in model:
            chunk.eval()
        losses = []
        with torch.no_grad():
            for _ in range(self.cfg.train.eval_iters):
                outputs = self.forward_backward_func(
                    forward_step_func=_forward_step,
                    data_iterator=iterators if len(model) > 1 else iterators[0],
                    model=model if len(model) > 1 else model[0],
                    num_microbatches=layout.grad_accum,
                    seq_length=layout.seq_length,
                    micro_batch_size=layout.micro_batch,
                    forward_only=True,
                )
                if self.reports_loss and outputs:
                    losses += [o["lm loss"] for o in outputs]
        for chunk in model:
            chunk.train()
        local = torch.stack(losses).mean().float() if losses else torch.zeros((), device=self.device)
        torch.distributed.all_reduce(local)
        return local.item() / layout.dp

    def update(self) -> Update:
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        return Update(bool(updated), None if grad_norm is None else float(grad_norm))

    def update_applied_anyway(self) -> bool:
        return False  # the update runs only after the gradient check

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def kernels(self) -> dict:
        """The core attention the layer spec chose, the Adam megatron-core steps (TE's or apex's
        FusedAdam, else torch's AdamW) and the layers' and loss's kernels its config asks for."""
        from toolkit.train.capabilities import qualified_name
        from toolkit.train.megatron_model import have_transformer_engine

        attention = next(
            (type(m) for chunk in self.chunks for name, m in chunk.named_modules() if name.endswith("core_attention")),
            None,
        )
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])[0].optimizer
        config = self.chunks[0].config  # the TransformerConfig the model was built with
        fused = backend_named("megatron").fused
        fused_layers = config.bias_activation_fusion or config.bias_dropout_fusion
        return {
            "attention": qualified_name(attention) if attention else None,
            "adam": qualified_name(type(inner)),
            "transformer_engine": have_transformer_engine(),
            "layers": fused.layers if fused_layers else fused.reference_layers,
            "loss": fused.loss if config.cross_entropy_loss_fusion else fused.reference_loss,
        }

    def save(self, root: Path, step: int, resumed_from: str | None = None) -> float:
        c = self.cfg.checkpoint
        self._sync_params()
        return save_checkpoint(
            root,
            step,
            self.chunks,
            self.optimizer,
            self.scheduler,
            self.layout,
            c.keep_last,
            self.cfg.train.fault,
            self.async_queue,
            c.verify,
            RESHARDABLE if c.reshardable else PARALLEL,
            model_parallel_layout(self.layout, self.cfg),
            ckpt.model_record(self.cfg),
            resumed_from,
        )

    def settle_saves(self, blocking: bool) -> None:
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        from megatron.core import parallel_state

        if self.async_queue is not None:
            self.async_queue.close()
        if self.config.tp_comm_overlap:
            from toolkit.train.megatron_model import destroy_tp_comm_overlap

            destroy_tp_comm_overlap()
        parallel_state.destroy_model_parallel()
        end_process_group()


def setup(cfg: Config, layout: Layout) -> MegatronSteps:
    """The megatron backend, built for the layout (toolkit.train.loop drives it)."""
    return MegatronSteps(cfg, layout)
