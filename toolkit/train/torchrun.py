"""`python -m toolkit.train.torchrun ARGS`: torchrun, with the same arguments, whose failed ranks
are reported in one message (toolkit.train.rank_errors) instead of torchrun's ChildFailedError
traceback; exits 1 when ranks failed, as torchrun does, and 128 + the signal's number, without a
traceback, when a stop signal ended it (after its agent stopped the ranks).

torch.distributed.run's `main` is `run(parse_args(argv))` under `@record`, which lets the
ChildFailedError propagate as a traceback; here it is caught and summarised. (`@record` also
copies the first failure into the launcher's own error file when a parent agent set one; nothing
parakit starts does.)
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from toolkit.train.rank_errors import summary

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as failed:
        print(summary(failed.failures), file=sys.stderr, flush=True)
        return 1
    except SignalException as stopped:  # a stop signal: the agent has stopped the ranks (toolkit.train.stop)
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
