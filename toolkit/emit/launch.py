"""launch.sh: torchrun on one node, or a Slurm batch script running torchrun on every node.

parakit never launches processes itself: torchrun does (elastic rendezvous, restarts), under
Slurm's `srun` with one task per node for multi-node runs, as the PyTorch elastic docs describe.
"""

from __future__ import annotations

import shlex

from toolkit.config.schema import Config
from toolkit.plan.backends import backend_of, logs_to
from toolkit.plan.checkpoint import saves_checkpoints
from toolkit.plan.layout import Layout

RDZV_PORT = 29500
# Every torchrun agent counts its own restarts, so after a restart the ranks of different nodes can
# meet in the store the agents share under different attempts' keys, or read a dead rank's address
# there, and hang or fail (pytorch#135712): each rendezvous round gets a fresh store instead.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# Every rank's environment, the same from launch.sh and from `parakit train`: (name, value, why, devices).
RANK_ENV = (
    # megatron-core orders its tensor- and sequence-parallel communication with the compute kernels
    # through a single hardware queue (megatron/core/tensor_parallel/layers.py warns without it)
    ("CUDA_DEVICE_MAX_CONNECTIONS", "1", "Megatron: keep TP/SP comm ordered with compute", ("cuda", "cpu")),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "a dead peer fails the collective instead of hanging it", ("cuda",)),
    ("DS_ACCELERATOR", "cpu", "DeepSpeed's CPU accelerator: gloo on CPU", ("cpu",)),
)


def rank_env(device: str) -> dict[str, str]:
    """The environment variables every rank on `device` gets."""
    return {name: value for name, value, _, devices in RANK_ENV if device in devices}


# Preemption (toolkit.train.preemption): the batch shell asks the ranks to stop by writing REQUEST
# in the run directory; rank 0 writes STOPPED once the checkpoint is published, and the shell requeues.
REQUEST = "preempt.request"
STOPPED = "preempted"
# Megatron-LM's pretrain_gpt.py (core_r0.19.0: argument_utils.gpt_config_from_args, and
# gpt_builders.gpt_builder) passes --use-rope-scaling on but not --rope-scaling-factor, so its model
# scales by GPTModelConfig's default factor whatever the flag says.
MEGATRON_LM_ROPE_SCALING_FACTOR = 8.0


def megatron_lm_refusal(cfg: Config) -> str | None:
    """Why Megatron-LM's pretrain_gpt.py would not train this run as planned; None where it would."""
    rs = cfg.model.rope_scaling
    if cfg.cluster.device != "cuda":
        return f"cluster.device={cfg.cluster.device}: Megatron-LM's pretrain_gpt.py trains on CUDA GPUs only (NCCL)"
    if rs.type == "llama3" and rs.factor != MEGATRON_LM_ROPE_SCALING_FACTOR:
        return (
            f"model.rope_scaling.factor={rs.factor:g}: Megatron-LM's pretrain_gpt.py ignores --rope-scaling-factor "
            f"and scales RoPE by {MEGATRON_LM_ROPE_SCALING_FACTOR:g}"
        )
    return None


# megatron_args.txt's lines are shell-quoted: Python's shlex reads them back into the very words
# (NUL-separated for mapfile), where $(cat ...) would split values at spaces and expand globs.
_READ_MEGATRON_ARGS = (
    "  mapfile -d '' -t MEGATRON_LM_ARGS < <(\"${PARAKIT_PYTHON:-python3}\" -c "
    '\'import shlex, sys; print(*shlex.split(open(sys.argv[1]).read()), sep="\\0", end="\\0")\' '
    '"$RUN_DIR/megatron_args.txt")'
)


def megatron_lm_run_flags(cfg: Config) -> list[str]:
    """pretrain_gpt.py's flags that name the run directory, as launch.sh's words (quoted, or on
    "$RUN_DIR"): its checkpoints in a folder of their own under the run's checkpoint folder (its
    iter_N layout is not parakit's step_N one), resumed when checkpoint.resume and saved when
    checkpoint.* saves; TensorBoard's events and the profiler's traces where parakit's would
    be; W&B's files in the run directory, under its name."""
    subfolder = "megatron-lm"
    folder = (
        shlex.quote(f"{cfg.checkpoint.dir}/{subfolder}")
        if cfg.checkpoint.dir
        else f'"$RUN_DIR/checkpoints/{subfolder}"'
    )
    words = ["--load", folder] if cfg.checkpoint.resume else []
    words += ["--save", folder] if saves_checkpoints(cfg) else []
    if logs_to(cfg, "tensorboard") or cfg.train.profile_step_start is not None:
        words += ["--tensorboard-dir", '"$RUN_DIR/tensorboard"']
    if logs_to(cfg, "wandb"):
        words += ["--wandb-save-dir", '"$RUN_DIR"', "--wandb-exp-name", '"$(basename "$RUN_DIR")"']
    return words


def _entry(cfg: Config) -> str:
    """What each rank runs: the parakit trainer on this run's resolved config, or for the
    megatron backend optionally Megatron-LM's pretrain_gpt.py with megatron_args.txt."""
    lines = [
        'ENTRY=(-m toolkit.train --config-dir "$RUN_DIR" --config-name config)',
        "# torchrun that reports failed ranks in one message (toolkit/train/torchrun.py), in the Python",
        "# that trains (PARAKIT_PYTHON, default python3 on PATH)",
        'TORCHRUN=("${PARAKIT_PYTHON:-python3}" -m toolkit.train.torchrun)',
    ]
    if backend_of(cfg).megatron_lm_entry:
        if refusal := megatron_lm_refusal(cfg):
            message = f"{refusal}; run parakit's trainer (unset PARAKIT_ENTRY)"
            run_megatron_lm = [f"  echo {shlex.quote(message)} >&2", "  exit 2"]
        else:
            run_flags = " ".join(megatron_lm_run_flags(cfg))
            run_megatron_lm = [
                "  # Megatron-LM checkout: MEGATRON_LM_DIR=/path/to/Megatron-LM",
                _READ_MEGATRON_ARGS,
                '  if [[ ${#MEGATRON_LM_ARGS[@]} -eq 0 ]]; then echo "cannot read $RUN_DIR/megatron_args.txt" >&2; '
                "exit 2; fi",
                '  ENTRY=("${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR}/pretrain_gpt.py" "${MEGATRON_LM_ARGS[@]}"'
                + (f" {run_flags})" if run_flags else ")"),
                "  TORCHRUN=(torchrun)  # its Python need not have parakit",
            ]
            if logs_to(cfg, "wandb") and str(cfg.train.wandb_mode) == "offline":  # Megatron-LM's wandb.init
                # takes no mode: the environment gives it
                run_megatron_lm.append('  export WANDB_MODE="${WANDB_MODE:-offline}"')
            if logs_to(cfg, "mlflow"):
                note = "parakit: Megatron-LM's pretrain_gpt.py has no MLflow logger; train.loggers' mlflow is parakit's"
                run_megatron_lm.append(f"  echo {shlex.quote(note)} >&2")
        lines += ['if [[ "${PARAKIT_ENTRY:-parakit}" == megatron-lm ]]; then', *run_megatron_lm, "fi"]
    return "\n".join(lines)


def _sbatch_lines(cfg: Config) -> list[str]:
    """The #SBATCH header of a multi-node script, from cluster.slurm."""
    c, slurm = cfg.cluster, cfg.cluster.slurm
    # The one task per node runs torchrun, which starts gpus_per_node ranks: on a CPU cluster a
    # CPU each (Slurm rejects GPUs that its nodes do not declare).
    cpus = slurm.cpus_per_task or (c.gpus_per_node if c.device == "cpu" else None)
    options = [
        f"--job-name=parakit-{cfg.model.name}",
        f"--nodes={c.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={c.gpus_per_node}"] if c.device != "cpu" else []),
        *([f"--cpus-per-task={cpus}"] if cpus else []),
        *(f"--{name}={value}" for name in SBATCH_SETTINGS if (value := getattr(slurm, name)) is not None),
        *(["--exclusive"] if slurm.exclusive else []),
        *([f"--signal=B:USR1@{slurm.signal_before_s}"] if slurm.signal_before_s else []),
        *(["--requeue"] if slurm.requeue else []),
        *([f"--output={slurm.log_dir}/%x-%j.out", "--open-mode=append"] if slurm.log_dir else []),
        *slurm.extra_sbatch,
    ]
    return [f"#SBATCH {option}" for option in options]


def _multi_node_body(cfg: Config, restarts: str) -> list[str]:
    """torchrun on every node of the job (srun, one task per node) or, without Slurm, on this one."""
    c, slurm = cfg.cluster, cfg.cluster.slurm
    container = [
        f"--{flag}={shlex.quote(value)}"
        for flag, value in (("container-image", slurm.container_image), ("container-mounts", slurm.container_mounts))
        if value
    ]
    if container:
        container.append('--container-workdir="$RUN_DIR"')
    torchrun = (
        f'"${{TORCHRUN[@]}}" --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node} {restarts} --rdzv-backend c10d '
        f'--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" "${{ENTRY[@]}}"'
    )
    ifname = shlex.quote(slurm.socket_ifname or "")
    return [
        *([f"LOG_DIR={shlex.quote(slurm.log_dir)}"] if slurm.log_dir else ['LOG_DIR="$RUN_DIR/logs"']),
        'LOG_DIR="${PARAKIT_LOG_DIR:-$LOG_DIR}"',
        'mkdir -p "$LOG_DIR"',
        f"export MASTER_PORT=${{MASTER_PORT:-{RDZV_PORT}}}",
        *([f"export NCCL_SOCKET_IFNAME={ifname} GLOO_SOCKET_IFNAME={ifname}"] if slurm.socket_ifname else []),
        'if [[ -n "${SLURM_JOB_ID:-}" ]]; then',
        "  # the rendezvous is on the job's first node; one log per node (appended to when requeued)",
        '  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        '  RDZV_ID="$SLURM_JOB_ID"',
        '  echo "parakit: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, run directory $RUN_DIR, node logs $LOG_DIR"',
        *_preemption_trap(slurm.requeue),
        '  srun --ntasks-per-node=1 --kill-on-bad-exit=1 --open-mode=append --output="$LOG_DIR/%x-%j-node%n.log" \\',
        *(f"    {flag} \\" for flag in container),
        f"    {torchrun} &",
        *_wait_and_requeue(slurm.requeue),
        "else",
        f"  # without Slurm: run this script on each of the {c.nodes} nodes, MASTER_ADDR naming the first",
        '  : "${MASTER_ADDR:?without Slurm set MASTER_ADDR to the first node (and the same RDZV_ID on every node)}"',
        '  RDZV_ID="${RDZV_ID:-parakit}"',
        f"  {torchrun}",
        "fi",
    ]


def _preemption_trap(requeue: bool) -> list[str]:
    """Slurm's USR1 (--signal=B:USR1@S) reaches this shell only (torchrun would die of it): ask
    the ranks to stop after their step with a checkpoint (toolkit.train.preemption)."""
    then = "; then the job requeues" if requeue else ""
    return [
        f'  rm -f "$RUN_DIR/{STOPPED}"',
        f'  trap \'echo "parakit: USR1 from Slurm: the ranks stop after this step with a checkpoint{then}"; '
        f'touch "$RUN_DIR/{REQUEST}"\' USR1',
    ]


def _wait_and_requeue(requeue: bool) -> list[str]:
    """srun runs in the background so that the trap runs at once; a wait the trap cuts short is
    waited again. Once the ranks stopped for preemption, the job goes back into the queue."""
    lines = [
        "  SRUN_PID=$!",
        "  set +e",
        "  while :; do",
        '    wait "$SRUN_PID"; STATUS=$?',
        '    kill -0 "$SRUN_PID" 2>/dev/null || break  # still running: the trap cut the wait short',
        "  done",
        "  set -e",
    ]
    if requeue:
        lines += [
            f'  if [[ -f "$RUN_DIR/{STOPPED}" ]]; then',
            f'    echo "parakit: stopped after step $(cat "$RUN_DIR/{STOPPED}") for preemption; requeueing job '
            '$SLURM_JOB_ID"',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "  fi",
        ]
    return [*lines, '  exit "$STATUS"']


# cluster.slurm fields written as the sbatch option of the same name, when set
SBATCH_SETTINGS = ("partition", "account", "qos", "time", "constraint")


def launch_script(cfg: Config, layout: Layout) -> str:
    """launch.sh for the run directory: torchrun on one node, or for several a Slurm batch script
    whose srun starts one torchrun per node (c10d rendezvous on the first), which also runs by hand
    on each node without Slurm; each rank runs `python -m toolkit.train`."""
    c = cfg.cluster
    header = [
        "#!/usr/bin/env bash",
        f"# parakit launch: {cfg.model.name} on {c.name} ({c.nodes} node(s) x {c.gpus_per_node} {c.gpu}), backend "
        f"{cfg.backend.name}",
        f"# layout: {layout.dims.label()}; "
        f"global batch {layout.global_batch} = micro {layout.micro_batch} x accum {layout.grad_accum} x dp {layout.dp}",
    ]
    if c.nodes > 1:
        header += _sbatch_lines(cfg)
    body = ["set -euo pipefail"]
    if c.nodes > 1:
        # sbatch runs a copy of the script from its spool directory: the run directory is where
        # it was submitted from (parakit train submits from there)
        body += [
            'RUN_DIR="${PARAKIT_RUN_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}}"',
            'if [[ ! -f "$RUN_DIR/config.yaml" ]]; then',
            '  echo "parakit: no config.yaml in $RUN_DIR: submit from the run directory (cd RUN_DIR && sbatch '
            'launch.sh) or set PARAKIT_RUN_DIR" >&2',
            "  exit 2",
            "fi",
        ]
    else:
        body.append('RUN_DIR="${PARAKIT_RUN_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"')
    body.append("export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
    body.append(f"export {' '.join(f'{k}={v}' for k, v in TORCHRUN_ENV.items())}  # a fresh store per restart")
    body += [f"export {name}={value}  # {why}" for name, value, why, devices in RANK_ENV if c.device in devices]
    body.append(_entry(cfg))
    restarts = f'--max-restarts "${{PARAKIT_MAX_RESTARTS:-{cfg.train.fault.max_restarts}}}"'
    if c.nodes == 1:
        body.append(
            f'"${{TORCHRUN[@]}}" --standalone --nnodes 1 --nproc-per-node {c.gpus_per_node} {restarts} "${{ENTRY[@]}}"'
        )
    else:
        body += _multi_node_body(cfg, restarts)
    return "\n".join(header + body) + "\n"
