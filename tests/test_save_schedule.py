"""When training saves (toolkit.train.save_schedule), in one process of world size 1: every N
steps, every M minutes of wall time, at the planner's interval after the first save, and always
at the last step."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import dataclasses, time, torch
    from toolkit.config.store import compose_config
    from toolkit.plan.checkpoint import checkpoint_plan
    from toolkit.plan.layout import resolve
    from toolkit.train.save_schedule import SaveSchedule
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)

    def schedule(*overrides):
        cfg = compose_config(["model=tiny", "cluster.gpus_per_node=1", "train.steps=10", *overrides])
        return cfg, SaveSchedule(cfg, resolve(cfg))

    _, none = schedule()
    assert not any(none.due(step) for step in range(1, 11)), "no interval: no saves, not even the last step"

    _, steps = schedule("checkpoint.interval_steps=3")
    assert [s for s in range(1, 11) if steps.due(s)] == [3, 6, 9, 10]

    _, clock = schedule("checkpoint.interval_minutes=0.002")  # 0.12 s
    assert not clock.due(1)
    time.sleep(0.2)
    assert clock.due(2)
    clock.saved(2, 0.01, 0.05)
    assert not clock.due(3) and clock.due(10)

    cfg, auto = schedule("checkpoint.auto_interval=true", "checkpoint.acceptable_rework_minutes=0.05")
    assert auto.due(1)  # the first save measures
    auto.saved(1, 0.5, 1.5)
    measured = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save_seconds=0.5))
    every = checkpoint_plan(measured, resolve(cfg), 1.5).recommended_steps
    assert every == 4, every  # the rework bound: 2 x 3 s / 1.5 s
    assert [s for s in range(2, 11) if auto.due(s)] == [4, 8, 10]
    print("schedule ok", flush=True)
""")


def test_save_schedule():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert "schedule ok" in result.stdout, result.stderr[-3000:]
