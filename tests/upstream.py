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
    from toolkit.train.megatron_configs import build_megatron_configs

    return build_megatron_configs(sections)
