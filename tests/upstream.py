"""Let DeepSpeed and megatron-core judge the generated configurations (no process group)."""

from __future__ import annotations

from unittest import mock


class DataParallelOnly:
    """The smallest Megatron-style mpu DeepSpeedConfig reads its world size from."""

    def __init__(self, dp: int, mp: int = 1):
        self.dp, self.mp = dp, mp

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return self.mp

    def get_model_parallel_rank(self):
        return 0


def deepspeed_accepts(ds_json: dict, dp: int, mp: int = 1):
    """DeepSpeedConfig at data-parallel world size `dp`; raises what DeepSpeed raises."""
    import deepspeed.runtime.config as ds_config

    # Without a process group DeepSpeedConfig falls back to world size 1 and ignores mpu
    # (it asks deepspeed.comm for the rank first); give it rank 0 so that it reads dp from mpu.
    with mock.patch.object(ds_config.dist, "get_rank", lambda *a, **k: 0):
        return ds_config.DeepSpeedConfig(ds_json, mpu=DataParallelOnly(dp, mp))


def megatron_accepts(sections: dict):
    """megatron-core's configuration objects built from the sections (its __post_init__ checks).
    MoE in fp8 makes TransformerConfig check Transformer Engine's version; this machine has no TE,
    which the validator requires where such a run trains (its package rule): the check is then
    that machine's, taken here as passed."""
    from unittest import mock

    from toolkit.train.megatron_configs import build_megatron_configs

    t = sections["transformer"]
    if t.get("fp8") and t.get("num_moe_experts"):
        from toolkit.compat import import_shims

        import_shims()
        from megatron.core.transformer import transformer_config

        with mock.patch.object(transformer_config, "is_te_min_version", lambda *a, **k: True):
            return build_megatron_configs(sections)
    return build_megatron_configs(sections)
