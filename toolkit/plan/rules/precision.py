"""Precision against the hardware: fp16 loss scaling, fp16 on CPU, a dtype the device lacks."""

from __future__ import annotations

from typing import Iterator

from toolkit.config.schema import Config
from toolkit.plan.rules.base import Violation, err


def dtype(cfg: Config) -> Iterator[Violation]:
    dtype, c, pr = cfg.precision.dtype, cfg.cluster, cfg.precision
    if dtype == "fp16" and pr.loss_scaling == "none":
        yield err(
            "fp16_loss_scale",
            {"precision.dtype": "fp16", "precision.loss_scaling": "none"},
            "fp16 gradients underflow without loss scaling (Micikevicius et al. 2018)",
            "set precision.loss_scaling=dynamic, or precision=bf16",
        )
    if dtype == "fp16" and c.device == "cpu":
        yield err(
            "fp16_cpu",
            {"precision.dtype": "fp16", "cluster.device": "cpu"},
            "fp16 training is not supported on CPU (DeepSpeed refuses it, torch lacks fast fp16 GEMMs)",
            "use precision=bf16 or precision=fp32 on CPU",
        )
    peak = {"bf16": c.peak_tflops_bf16, "fp8": c.peak_tflops_fp8, "fp16": c.peak_tflops_fp16}.get(dtype)
    if peak is not None and peak <= 0 and not (dtype == "fp16" and c.device == "cpu"):
        alternative = (
            "precision=fp16"
            if dtype == "bf16" and c.peak_tflops_fp16 > 0
            else "precision=bf16"
            if c.peak_tflops_bf16 > 0
            else "precision=fp32"
        )
        yield err(
            "dtype_hardware",
            {"precision.dtype": dtype, "cluster.gpu": c.gpu, f"cluster.peak_tflops_{dtype}": peak},
            f"this hardware has no {dtype} support",
            f"use {alternative}",
        )
