"""Worker entry: `python -m toolkit.train --config-dir RUN_DIR [--config-name config] [--convert-checkpoint]`.

torchrun starts one of these per rank (launch.sh, or `parakit train` for several local ranks).
It reads the resolved configuration that `parakit generate`/`train` wrote, so the layout that
trains is the layout the validator accepted and the emitters wrote. With --convert-checkpoint the
ranks convert the newest checkpoint instead of training (toolkit.train.megatron_reshard).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from toolkit.config.store import load_run_config
from toolkit.plan.validate import ValidationError
from toolkit.train import rank_errors
from toolkit.train.console import log_rank_to_file
from toolkit.train.trainer import quiet_upstream_notices, run_to_exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.train", description=__doc__)
    parser.add_argument("--config-dir", type=Path, required=True, help="run directory holding config.yaml")
    parser.add_argument("--config-name", default="config")
    parser.add_argument(
        "--convert-checkpoint",
        action="store_true",
        help="load the newest megatron checkpoint at this layout and save it again fully reshardable",
    )
    args = parser.parse_args(argv)
    quiet_upstream_notices()
    log_rank_to_file(args.config_dir, int(os.environ.get("RANK", "0")))
    from toolkit.train.distributed import detach_resource_tracker, end_helper_processes, end_helpers_on_sigterm

    detach_resource_tracker()
    end_helpers_on_sigterm()
    try:
        cfg = load_run_config(args.config_dir, args.config_name)
        if args.convert_checkpoint:
            from toolkit.train.megatron_reshard import convert

            convert(cfg)
            return 0
        return run_to_exit_code(cfg, args.config_dir)
    except ValidationError as error:
        rank_errors.known(str(error))
        return 2
    # nothing foresaw it (DCP's CheckpointException is a BaseException): the launcher names the rank and the cause once
    except (Exception, CheckpointException) as error:
        if not rank_errors.unexpected(error, args.config_dir):
            raise
        return 1
    finally:
        end_helper_processes()


if __name__ == "__main__":
    code = main()
    # Everything is written, published and closed by now; what remains is the C++ teardown of
    # torch and gloo at interpreter exit, which holds each rank ~1 s (measured on CPU) before
    # torchrun sees it end. Leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
