"""ZeRO's offload options against the stage they need."""

from __future__ import annotations

from typing import Iterator

from toolkit.config.schema import Config
from toolkit.plan.rules.base import Violation, err


def offload(cfg: Config) -> Iterator[Violation]:
    z = cfg.zero
    if z.offload_optimizer != "none" and z.stage == 0:
        yield err(
            "offload_stage",
            {"zero.offload_optimizer": z.offload_optimizer, "zero.stage": 0},
            "optimizer offload partitions optimizer states and needs ZeRO >= 1",
            "use zero=2_offload, or zero.stage>=1",
        )
    if z.offload_param != "none" and z.stage != 3:
        yield err(
            "offload_stage",
            {"zero.offload_param": z.offload_param, "zero.stage": z.stage},
            "parameter offload needs ZeRO-3 (parameters partitioned)",
            "use zero=3_offload, or zero.offload_param=none",
        )
    if "nvme" in (z.offload_optimizer, z.offload_param) and not z.nvme_path:
        yield err(
            "offload_nvme",
            {"zero.nvme_path": z.nvme_path},
            "NVMe offload needs a local NVMe folder",
            "set zero.nvme_path=/local_nvme/ds_offload",
        )
