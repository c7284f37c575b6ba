"""For each configuration given (a JSON list of override lists on stdin), the learning rate of
every training step as each backend's library applies it:
- megatron: megatron-core's OptimizerParamScheduler built from the emitted megatron.yaml
  arguments, stepped after each update as the megatron trainer (and Megatron-LM) does;
- deepspeed: a real DeepSpeed engine (one process, the emitted JSON, the trainer's
  initialize_engine) stepping its scheduler itself, read with engine.get_lr() before each update.
Prints {"megatron": [[lr, ...], ...], "deepspeed": [[lr, ...], ...]} as JSON."""
import json
import logging
import os
import sys

import torch

from toolkit.train import mcore_cpu


def main():
    from toolkit.compat import import_shims

    import_shims()
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from toolkit.config.store import compose_config
    from toolkit.emit.deepspeed import deepspeed_config
    from toolkit.emit.megatron import megatron_sections
    from toolkit.plan.layout import resolve
    from toolkit.train.deepspeed_engine import init_deepspeed, initialize_engine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed = init_deepspeed()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    out = {"megatron": [], "deepspeed": []}
    for overrides in json.loads(sys.stdin.read()):
        cfg = compose_config(overrides)
        layout = resolve(cfg)
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=layout.lr)
        scheduler = OptimizerParamScheduler(optimizer, **megatron_sections(cfg, layout)["scheduler"])
        lrs = []
        for _ in range(layout.steps):
            lrs.append(optimizer.param_groups[0]["lr"])
            scheduler.step(increment=1)
        out["megatron"].append(lrs)

        model = torch.nn.Linear(2, 2)
        engine = initialize_engine(deepspeed, model, cfg, layout, deepspeed_config(cfg, layout))
        lrs = []
        for _ in range(layout.steps):
            lrs.append(engine.get_lr()[0])
            for _ in range(layout.grad_accum):
                engine.backward(engine(torch.ones(layout.micro_batch, 2)).sum())
                engine.step()
        out["deepspeed"].append(lrs)
    print(json.dumps(out))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
