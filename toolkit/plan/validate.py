"""The layout validator: every rule a configuration must pass before a GPU-hour is spent.

Pure Python. `validate(cfg)` returns all errors and warnings at once; each names the fields,
their values, the rule, and a concrete fix. Errors are what DeepSpeed or Megatron would reject
(often only after a few steps); warnings are valid layouts that run slowly or train differently.
`check(cfg)` raises `ValidationError` when there are errors and returns the resolved `Layout`.
The rules live in toolkit.plan.rules, one module per theme; this module runs them.

Sources for the rules: Megatron-LM `megatron/training/arguments.py::validate_args`, megatron-core
`TransformerConfig.__post_init__` and schedules, DeepSpeed `runtime/config.py` and
`runtime/pipe/engine.py`; the batch, learning-rate and warmup checks after the global batch
changes follow Goyal et al. 2017, "Accurate, Large Minibatch SGD", sections 2.1-2.2.
"""

from __future__ import annotations

import netrc
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Iterator
from urllib.parse import urlparse

from toolkit.config.schema import Config
from toolkit.plan.backends import Package, logs_to, mlflow_store, packages_needed
from toolkit.plan.fit import memory_problem
from toolkit.plan.layout import Layout, resolve
from toolkit.plan.rules import (
    batch,
    capabilities,
    comm,
    experts,
    model,
    parallel,
    precision,
    ranges,
    secrets,
    slow,
    slurm,
    training,
    weights,
    zero,
)
from toolkit.plan.rules import data as data_rules
from toolkit.plan.rules.base import ERROR, Violation, err, warn


@dataclass(frozen=True)
class Report:
    errors: tuple[Violation, ...]
    warnings: tuple[Violation, ...]
    packages: tuple[Package, ...] = ()  # what the options need on the machines that train

    @property
    def ok(self) -> bool:
        return not self.errors

    def needs(self) -> str:
        """One line naming the packages the machines that train need, or "" when none."""
        if not self.packages:
            return ""
        reasons: dict[str, list[str]] = {}  # one entry per package, with every option that needs it
        for p in self.packages:
            reasons.setdefault(p.install, []).append(f"{p.field}={p.value}: {p.why}")
        listing = "; ".join(f"{install} ({'; '.join(why)})" for install, why in reasons.items())
        return f"needs on the machines that train: {listing}"

    def __str__(self) -> str:
        lines = [str(v) for v in self.errors + self.warnings] + [self.needs()] * bool(self.packages)
        return "\n".join(lines) if lines else "ok: no errors, no warnings"


class ValidationError(ValueError):
    """Raised by `check` with every error of the configuration."""

    def __init__(self, report: Report):
        self.report = report
        count = len(report.errors)
        super().__init__(f"{count} configuration error{'s' * (count != 1)}:\n" + "\n".join(map(str, report.errors)))


# In the order they report.
_ERROR_RULES: tuple[Callable[[Config], Iterator[Violation]], ...] = (
    secrets.passwords,
    model.shape,
    weights.hf_path,
    weights.hf_weights,
    weights.init_checkpoint,
    model.rope,
    parallel.world,
    parallel.layout,
    parallel.backend_dims,
    experts.dense,
    experts.family,
    experts.experts,
    batch.split,
    capabilities.backend,
    zero.offload,
    comm.instances,
    comm.zeropp,
    precision.dtype,
    training.recompute,
    training.optim,
    training.checkpoint,
    training.profile,
    training.kernels,
    training.fault_ranks,
    slurm.signal_lead,
)


def _memory(cfg: Config) -> Iterator[Violation]:
    """Will it fit: the planner's peak memory on the busiest rank against the device's
    (toolkit.plan.fit names the largest term and the smallest change that fits)."""
    if cfg.checks.memory == "off":
        return
    problem = memory_problem(cfg, lambda changed: validate(changed, data=False, memory=False).ok)
    if problem:
        severity = err if problem.certain and cfg.checks.memory == "error" else warn
        yield severity("memory", problem.fields, problem.message, problem.fix)


def _missing_packages(packages: tuple[Package, ...], installed: Callable[[str], bool]) -> Iterator[Violation]:
    """On the machine that trains: the packages the options need and this machine cannot import."""
    for package in packages:
        if not installed(package.module):
            yield err(
                "package",
                {package.field: package.value},
                f"{package.why}, and this machine cannot import {package.module}",
                f"pip install {package.install} on the machines that train, or {package.instead}",
            )


def missing_gpus(cfg: Config, gpus: int) -> Iterator[Violation]:
    """On the machine that trains: a GPU cluster needs its GPUs here (else a run builds the model and
    then fails inside a CUDA kernel, or puts several ranks on one GPU)."""
    cluster = cfg.cluster
    if cluster.device != "cuda" or gpus >= cluster.gpus_per_node:
        return
    has = f"this machine has {gpus} CUDA GPU{'s' * (gpus != 1)}" if gpus else "this machine has no CUDA GPU"
    yield err(
        "device",
        {"cluster": cluster.name, "cluster.gpus_per_node": cluster.gpus_per_node},
        f"cluster {cluster.name} runs {cluster.gpus_per_node} rank(s) per node on CUDA GPUs and {has}",
        "run where the cluster's GPUs are, or train on this machine with cluster=cpu"
        + (f" (or cluster.gpus_per_node={gpus})" if gpus else ""),
    )


def wandb_login(cfg: Config) -> Iterator[Violation]:
    """On the machine that starts the ranks: W&B online needs credentials (WANDB_API_KEY, or the
    ~/.netrc entry `wandb login` writes); without them wandb.init fails once the model is built."""
    if not logs_to(cfg, "wandb") or str(cfg.train.wandb_mode) != "online":
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        entry = netrc.netrc().authenticators(host)
    except (OSError, netrc.NetrcParseError):
        entry = None
    if os.environ.get("WANDB_API_KEY") or entry:
        return
    yield err(
        "wandb_login",
        {"train.wandb_mode": "online"},
        f"W&B has no credentials on this machine: no WANDB_API_KEY and no {host} entry in ~/.netrc",
        "run `wandb login` (or set WANDB_API_KEY) where the ranks run, or set train.wandb_mode=offline "
        "(`wandb sync` uploads the run later)",
    )


# How long the machine that starts the ranks waits for an MLflow server's answer. MLflow's own
# client retries a refused connection 7 times with a growing back-off (mlflow.environment_variables:
# MLFLOW_HTTP_REQUEST_MAX_RETRIES, _BACKOFF_FACTOR): a typo in the URI failed rank 0 after 4 minutes,
# once every rank had built its model.
MLFLOW_ANSWER_S = 5.0


def mlflow_server(cfg: Config) -> Iterator[Violation]:
    """On the machine that starts the ranks: an MLflow server (http or https tracking URI) answers.
    Any HTTP answer counts (its /health, or an error status from a server behind a login): only no
    connection at all is refused."""
    uri = mlflow_store(cfg) if logs_to(cfg, "mlflow") else None
    if not uri or urlparse(uri).scheme not in ("http", "https"):
        return
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=MLFLOW_ANSWER_S).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError) as error:
        field = "train.mlflow_tracking_uri" if cfg.train.mlflow_tracking_uri else "$MLFLOW_TRACKING_URI"
        reason = getattr(error, "reason", error)
        yield err(
            "mlflow_server",
            {field: uri},
            f"no MLflow server answers at {uri} within {MLFLOW_ANSWER_S:g} s ({reason})",
            f"start the server (`mlflow server --host 0.0.0.0 --port 5000`) or correct {field} (with "
            "neither train.mlflow_tracking_uri nor $MLFLOW_TRACKING_URI, MLflow logs to <run dir>/mlflow.db)",
        )


def validate(
    cfg: Config,
    *,
    data: bool = True,
    memory: bool = True,
    installed: Callable[[str], bool] | None = None,
    gpus: int | None = None,
) -> Report:
    """Every error and warning of `cfg`, at once. `data=False` leaves out the rules about the
    training data (the layout search: a layout does not depend on the data); `memory=False` the
    memory check (the search weighs memory itself). `installed(module)` says whether this machine
    imports a module: given on the machine that trains, a package an option needs and this machine
    lacks is an error; without it (planning elsewhere) the report lists what the options need.
    `gpus`, given where the run starts its ranks, is how many CUDA GPUs this machine has."""
    errors, packages = _errors(cfg, data, installed)
    if gpus is not None and not any(e.rule == "range" for e in errors):
        errors += missing_gpus(cfg, gpus)
        errors += wandb_login(cfg)
        errors += mlflow_server(cfg)
    warnings = []
    if not errors and memory:
        found = list(_memory(cfg))
        errors += [v for v in found if v.severity == ERROR]
        warnings += [v for v in found if v.severity != ERROR]
    if not errors:
        warnings += list(experts.etp_default(cfg))
        warnings += list(experts.stage_balance(cfg))
        warnings += list(comm.costly(cfg))
        warnings += list(training.profile_window(cfg))
        warnings += list(training.kernels_kept(cfg))
        warnings += list(training.loggers(cfg))
        warnings += list(slow.slow_layouts(cfg, resolve(cfg)))
    return Report(tuple(errors), tuple(warnings), packages)


def is_valid(cfg: Config, *, data: bool = True) -> bool:
    """validate(cfg, data=data, memory=False).ok, without working out the warnings (what the layout
    search asks of each candidate)."""
    return not _errors(cfg, data, None)[0]


def _errors(
    cfg: Config, data: bool, installed: Callable[[str], bool] | None
) -> tuple[list[Violation], tuple[Package, ...]]:
    """The errors of every rule but the memory check's, and the packages the options need."""
    errors = list(ranges.ranges(cfg))
    packages: tuple[Package, ...] = ()
    if not any(e.rule == "range" for e in errors):  # the other rules divide by these values
        for rule in _ERROR_RULES:
            errors.extend(rule(cfg))
        if data:
            errors.extend(data_rules.data(cfg))
        packages = tuple(packages_needed(cfg))
        if installed is not None:
            errors.extend(_missing_packages(packages, installed))
    return errors, packages


def check(cfg: Config, installed: Callable[[str], bool] | None = None) -> tuple[Layout, Report]:
    """The resolved layout and the report's warnings; raises `ValidationError` on errors."""
    report = validate(cfg, installed=installed)
    if not report.ok:
        raise ValidationError(report)
    return resolve(cfg), report
