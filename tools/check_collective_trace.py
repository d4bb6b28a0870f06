"""Check collective traces against NCCL's rules (fp8.comm_trace.check_traces).

``pretrain_gpt.py --collective-trace DIR`` writes every rank's ``torch.distributed`` calls to
``DIR/rank<R>.jsonl`` and checks them itself at the end of a run; this command checks a directory again, e.g.
the traces a failed or killed run left behind:

    python tools/check_collective_trace.py DIR [--world-size N]

Exit status: 0 when the calls follow NCCL's rules, 1 when they break one (each violation printed), 2 when the
traces cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

if __name__ == "__main__":  # run as a script from a checkout: the repository root holds fp8
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8.comm_trace import P2P_KINDS, check_traces, load_traces  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="the --collective-trace directory (rank<R>.jsonl files)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="require the traces of ranks 0..N-1 (default: every rank*.jsonl found)")
    args = parser.parse_args(argv)
    try:
        traces = load_traces(args.directory, args.world_size)
    except (FileNotFoundError, ValueError) as error:
        print(f"check_collective_trace.py: {error}", file=sys.stderr)
        return 2
    calls = sum(len(c) for c in traces.values())
    kinds = Counter(call.kind for c in traces.values() for call in c)
    batched = sum(1 for c in traces.values() for call in c if call.kind in P2P_KINDS and call.batch is not None)
    print(f"{args.directory}: {calls} calls on {len(traces)} ranks: "
          + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
          + f"; {batched} point-to-point operations in batch_isend_irecv groups")
    violations = check_traces(traces)
    for violation in violations:
        print(violation)
    if violations:
        print(f"{len(violations)} violation(s) of NCCL's rules: this run would deadlock or hang on NCCL")
        return 1
    print("NCCL's rules hold: no point-to-point deadlock, every group's collectives agree in kind, order and size")
    return 0


if __name__ == "__main__":
    sys.exit(main())
