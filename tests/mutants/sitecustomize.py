"""Test-only defects for the mutation tests; the product never enables them.

tests/training_runs.run(mutation=NAME) puts this folder on PYTHONPATH and sets PARAKIT_MUTATION,
so every Python process of that run (the launcher, torchrun's ranks) imports this module at
start-up and patches parakit before it runs. Each defect is one a broken layout, converter or
resume could really have; the test meant to catch it must then fail.
"""

import os


def _multi_rank() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def frozen_mlp():
    """The last decoder layer's MLP is never updated in a multi-rank run of the deepspeed backend
    (as if its pipeline stage's parameters never reached the optimizer)."""
    from toolkit.train import deepspeed_engine

    build_hf_model = deepspeed_engine.build_hf_model

    def hf_model(*args, **kwargs):
        model = build_hf_model(*args, **kwargs)
        if _multi_rank():
            model.model.layers[-1].mlp.requires_grad_(False)
        return model

    deepspeed_engine.build_hf_model = hf_model


def doubled_gradients():
    """Every gradient doubled in a multi-rank run (megatron backend): a loss scaled twice."""
    from toolkit.train import megatron_backend

    loss = megatron_backend._loss

    def doubled(*args):
        value, report = loss(*args)
        return (value * 2 if _multi_rank() else value), report

    megatron_backend._loss = doubled


def cp_whole_sequence():
    """Every context-parallel rank is fed the whole sequence instead of its share (megatron backend)."""
    from toolkit.train import megatron_backend

    megatron_backend._cp_share = lambda batch: batch


def sp_norm_grads_not_summed():
    """Under sequence parallel the norms' gradients are not summed over the tensor-parallel ranks:
    each rank keeps the gradient of its own share of the sequence (megatron backend, torch norms)."""
    from toolkit.train import megatron_model

    build = megatron_model.TorchNorm.__new__

    def unmarked(cls, *args, **kwargs):
        norm = build(cls, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = False
        return norm

    megatron_model.TorchNorm.__new__ = staticmethod(unmarked)


def scheduler_state_dropped():
    """A resumed run forgets the learning-rate scheduler's state (megatron backend)."""
    from types import SimpleNamespace

    from toolkit.train import megatron_backend

    load = megatron_backend.load_checkpoint

    def load_without_scheduler(root, chunks, optimizer, scheduler, layout, *rest):
        return load(root, chunks, optimizer, SimpleNamespace(load_state_dict=lambda state: None), layout, *rest)

    megatron_backend.load_checkpoint = load_without_scheduler


def norms_decayed():
    """The deepspeed backend applies weight decay to norms and biases too (megatron-core does not)."""
    from toolkit.train import deepspeed_engine

    def one_group(module, weight_decay):
        return [{"params": [p for p in module.parameters() if p.requires_grad], "weight_decay": weight_decay}]

    deepspeed_engine.optimizer_groups = one_group


def random_state_not_restored():
    """A resumed run keeps its fresh random state instead of the checkpoint's (megatron backend)."""
    from toolkit.train import megatron_backend

    megatron_backend._set_rng_state = lambda state: None


def resume_gives_up():
    """The search for a checkpoint to resume from gives up when the newest one fails to verify,
    and the run starts from scratch."""
    from toolkit.train import checkpoint

    def newest_or_nothing(root, level, load):
        newest = checkpoint._candidates(root)[:1]
        problem = checkpoint.verify_collectively(newest[0], level) if newest else "none"
        if problem is None:
            return newest[0], load(newest[0]), []
        return None, None, [{"checkpoint": newest[0].name if newest else str(root), "problem": problem}]

    checkpoint.load_collectively = newest_or_nothing


def _when_megatron_builds(patch) -> None:
    """Run `patch` once megatron-core is imported and set up (when the model is built): importing
    it here, at interpreter start-up, would come before parakit's CPU set-up."""
    from toolkit.train import megatron_model

    build = megatron_model.build_model_chunks

    def patched_build(*args, **kwargs):
        patch()
        return build(*args, **kwargs)

    megatron_model.build_model_chunks = patched_build


def moe_tokens_misrouted():
    """In a multi-rank run each expert is handed its neighbour's token (the dispatcher's
    permutation off by one row), as a broken permute/unpermute would do (megatron backend)."""

    def patch():
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        postprocess = MoEAlltoAllTokenDispatcher.dispatch_postprocess

        def misrouted(self, hidden_states, probs):
            tokens, tokens_per_expert, permuted_probs = postprocess(self, hidden_states, probs)
            return (tokens.roll(1, dims=0) if _multi_rank() else tokens), tokens_per_expert, permuted_probs

        MoEAlltoAllTokenDispatcher.dispatch_postprocess = misrouted

    _when_megatron_builds(patch)


def expert_grads_unreduced():
    """The experts' gradients are not reduced over their expert-data-parallel ranks: every rank
    applies the first rank's (megatron backend; a DDP that left out the expert buffers)."""

    def patch():
        import torch
        from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

        init = DistributedDataParallel.__init__

        def unreduced(self, *args, **kwargs):
            init(self, *args, **kwargs)
            for bucket_group in self.expert_parallel_bucket_groups:
                start = bucket_group.start_grad_sync

                def first_ranks_only(*a, bucket_group=bucket_group, start=start, **k):
                    group = getattr(bucket_group, "intra_distributed_optimizer_instance_group", None)
                    group = group or bucket_group.data_parallel_group
                    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
                    for bucket in bucket_group.buckets:  # the average then is rank 0's own gradient
                        bucket.grad_data.mul_(size if rank == 0 else 0)
                    return start(*a, **k)

                bucket_group.start_grad_sync = first_ranks_only

        DistributedDataParallel.__init__ = unreduced

    _when_megatron_builds(patch)


def instances_unreduced():
    """With several distributed-optimizer instances, the all-reduce across them is skipped: each
    instance updates with its own ranks' gradients (megatron backend)."""

    def patch():
        import torch
        from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

        init = DistributedDataParallel.__init__

        def unreduced(self, *args, **kwargs):
            init(self, *args, **kwargs)
            # every rank alone: the all-reduce across instances reduces nothing (new_group is
            # collective, so every rank creates every group)
            world = torch.distributed.get_world_size()
            alone = [torch.distributed.new_group([r]) for r in range(world)][torch.distributed.get_rank()]
            for bucket_group in self.bucket_groups:
                bucket_group.inter_distributed_optimizer_instance_group = alone

        DistributedDataParallel.__init__ = unreduced

    _when_megatron_builds(patch)


def hpz_stale():
    """ZeRO++ hpZ's secondary partition is never refreshed after an optimizer step: the backward
    gathers the parameters of the first step (deepspeed backend)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    DeepSpeedZeroOptimizer_Stage3.invalidate_secondary_tensor = lambda self: None


def fp32_reduction_always():
    """The deepspeed backend reduces gradients in fp32 whatever precision.grad_reduce_in_fp32 says."""
    import dataclasses

    from toolkit.emit import deepspeed

    dtypes = deepspeed._gradient_dtypes

    def always_fp32(cfg):
        return dtypes(dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, grad_reduce_in_fp32=True)))

    deepspeed._gradient_dtypes = always_fp32


def router_losses_dropped():
    """The deepspeed backend logs the routers' losses but leaves them out of what it trains."""
    from toolkit.train import router_losses

    losses = router_losses.router_losses

    def logged_only(*args):
        out = losses(*args)
        return router_losses.RouterLosses(out.total.detach() * 0, out.logged)

    router_losses.router_losses = logged_only


def router_losses_as_transformers():
    """The deepspeed backend trains (and logs) transformers' load_balancing_loss_func, which pools
    every layer's tokens before the product of the two means, instead of megatron-core's per-layer loss."""
    from toolkit.train import router_losses

    losses = router_losses.router_losses

    def pooled(router_logits, moe, sequences):
        import dataclasses

        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        z_only = losses(router_logits, dataclasses.replace(moe, aux_loss_coeff=0.0), sequences)
        aux = load_balancing_loss_func(router_logits, moe.num_experts, moe.router_topk)
        return router_losses.RouterLosses(
            z_only.total + moe.aux_loss_coeff * aux, {**z_only.logged, "moe_aux_loss": aux.detach()}
        )

    router_losses.router_losses = pooled


MUTATIONS = {
    f.__name__: f
    for f in (
        frozen_mlp,
        doubled_gradients,
        cp_whole_sequence,
        sp_norm_grads_not_summed,
        norms_decayed,
        scheduler_state_dropped,
        random_state_not_restored,
        resume_gives_up,
        moe_tokens_misrouted,
        expert_grads_unreduced,
        router_losses_dropped,
        router_losses_as_transformers,
        instances_unreduced,
        hpz_stale,
        fp32_reduction_always,
    )
}

if os.environ.get("PARAKIT_MUTATION"):
    MUTATIONS[os.environ["PARAKIT_MUTATION"]]()
