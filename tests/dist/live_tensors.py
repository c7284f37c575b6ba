"""Bytes held by every live tensor storage of this process (each storage counted once), and the
loop that measures several configurations in one process."""
import gc
import json

import torch


def live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
        except Exception:
            continue
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure_cases(cases: list, cfgs: list, held_bytes, forget, out: str) -> None:
    """For each case: `held_bytes(cfg, baseline)` -> (bytes, parameters), then `forget()` what the
    libraries keep of it; the live bytes must be back at the baseline before the next case (the
    last case may leave some: nothing is measured after it). Rank 0 writes one {"ranks", "params"}
    per case to `out`."""
    baseline = live_tensor_bytes()
    measured = []
    for index, (overrides, cfg) in enumerate(zip(cases, cfgs)):
        held, params = held_bytes(cfg, baseline)
        forget()
        left = live_tensor_bytes() - baseline
        assert left == 0 or index == len(cases) - 1, f"{overrides}: {left} bytes outlive the case"
        results = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(results, {"rank": torch.distributed.get_rank(), "bytes": held})
        measured.append({"ranks": results, "params": params})
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(measured, f)
