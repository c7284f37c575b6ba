"""launch.sh: torchrun on one node, or a Slurm batch script running torchrun on every node.

parakit never launches processes itself: torchrun does (elastic rendezvous, restarts), under
Slurm's `srun` with one task per node for multi-node runs, as the PyTorch elastic docs describe.
"""

from __future__ import annotations

from toolkit.config.schema import Config
from toolkit.plan.backends import backend_of
from toolkit.plan.layout import Layout

RDZV_PORT = 29500
# Megatron-LM's pretrain_gpt.py (core_r0.19.0: argument_utils.gpt_config_from_args, and
# gpt_builders.gpt_builder) passes --use-rope-scaling on but not --rope-scaling-factor, so its model
# scales by GPTModelConfig's default factor whatever the flag says.
MEGATRON_LM_ROPE_SCALING_FACTOR = 8.0


def _entry(cfg: Config) -> str:
    """What each rank runs: the parakit trainer on this run's resolved config, or for the
    megatron backend optionally Megatron-LM's pretrain_gpt.py with megatron_args.txt."""
    lines = [
        'ENTRY=(-m toolkit.train --config-dir "$RUN_DIR" --config-name config)',
    ]
    if backend_of(cfg).megatron_lm_entry:
        rs = cfg.model.rope_scaling
        if rs.type == "llama3" and rs.factor != MEGATRON_LM_ROPE_SCALING_FACTOR:
            run_megatron_lm = [
                f"  echo \"model.rope_scaling.factor={rs.factor:g}: Megatron-LM's pretrain_gpt.py ignores "
                f"--rope-scaling-factor and scales RoPE by {MEGATRON_LM_ROPE_SCALING_FACTOR:g}; "
                "run parakit's trainer (unset PARAKIT_ENTRY)\" >&2",
                "  exit 2",
            ]
        else:
            run_megatron_lm = [
                "  # Megatron-LM checkout: MEGATRON_LM_DIR=/path/to/Megatron-LM",
                "  # shellcheck disable=SC2046  # one flag and its value per line: split on whitespace",
                '  ENTRY=("${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR}/pretrain_gpt.py" '
                '$(cat "$RUN_DIR/megatron_args.txt"))',
            ]
        lines += ['if [[ "${PARAKIT_ENTRY:-parakit}" == megatron-lm ]]; then', *run_megatron_lm, "fi"]
    return "\n".join(lines)


def launch_script(cfg: Config, layout: Layout) -> str:
    """launch.sh for the run directory: torchrun on one node, or an sbatch script whose srun starts
    one torchrun per node (c10d rendezvous) for several; each rank runs `python -m toolkit.train`."""
    c = cfg.cluster
    header = [
        "#!/usr/bin/env bash",
        f"# parakit launch: {cfg.model.name} on {c.name} ({c.nodes} node(s) x {c.gpus_per_node} {c.gpu}), backend "
        f"{cfg.backend.name}",
        f"# layout: tp={layout.tp} pp={layout.pp} vpp={layout.vpp} cp={layout.cp} dp={layout.dp}; "
        f"global batch {layout.global_batch} = micro {layout.micro_batch} x accum {layout.grad_accum} x dp {layout.dp}",
    ]
    if c.nodes > 1:
        header += [
            f"#SBATCH --job-name=parakit-{cfg.model.name}",
            f"#SBATCH --nodes={c.nodes}",
            "#SBATCH --ntasks-per-node=1",
            # the one task per node runs torchrun, which starts gpus_per_node ranks: on a CPU
            # cluster a CPU each (Slurm rejects GPUs that its nodes do not declare)
            f"#SBATCH --cpus-per-task={c.gpus_per_node}"
            if c.device == "cpu"
            else f"#SBATCH --gpus-per-node={c.gpus_per_node}",
            "#SBATCH --exclusive",
        ]
    body = [
        "set -euo pipefail",
        'RUN_DIR="${PARAKIT_RUN_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"',
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
    ]
    if c.device == "cpu":
        body.append("export DS_ACCELERATOR=cpu  # gloo on CPU")
    else:
        body.append("export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron: keep TP/SP comm ordered with compute")
    body.append(_entry(cfg))
    restarts = f"--max-restarts ${{PARAKIT_MAX_RESTARTS:-{cfg.train.fault.max_restarts}}}"
    if c.nodes == 1:
        body.append(f'torchrun --standalone --nnodes 1 --nproc-per-node {c.gpus_per_node} {restarts} "${{ENTRY[@]}}"')
    else:
        body += [
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f'srun --ntasks-per-node=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {c.gpus_per_node} '
            f"{restarts} \\",
            f'  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:{RDZV_PORT}" --rdzv-id "$SLURM_JOB_ID" '
            f'"${{ENTRY[@]}}"',
        ]
    return "\n".join(header + body) + "\n"
