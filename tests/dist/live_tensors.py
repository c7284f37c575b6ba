"""Bytes held by every live tensor storage of this process (each storage counted once)."""
import gc

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
