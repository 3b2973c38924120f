"""``make chaos``: the chaos scenarios again and again, longer, for CHAOS_MINUTES.

Prints the seed first. Each round runs ``pytest tests/integration/chaos`` with ``CHAOS_LONG=1``
(longer fault phases, more faults) and its own seed drawn from that one, so the same
``CHAOS_SEED`` replays the same schedule of rounds and faults (timings still vary:
the faults strike real processes). Stops at the first failing round and says how to
replay it. Environment: CHAOS_SEED (default: random), CHAOS_MINUTES (default 10),
CHAOS_PYTEST_ARGS (extra pytest arguments, e.g. ``-k sentinel``).
"""

from __future__ import annotations

import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAX_ROUNDS = 1000


def main() -> int:
    """Run rounds until the time is up or one fails; the exit status of the last round."""
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**32))
    minutes = float(os.environ.get("CHAOS_MINUTES") or 10)
    extra = shlex.split(os.environ.get("CHAOS_PYTEST_ARGS", ""))
    print(f"chaos: CHAOS_SEED={seed} CHAOS_MINUTES={minutes:g}", flush=True)
    rng = random.Random(seed)
    deadline = time.monotonic() + minutes * 60
    rounds = 0
    started = time.monotonic()
    for rounds in range(1, MAX_ROUNDS + 1):
        round_seed = rng.randrange(2**32)
        print(f"\nchaos round {rounds}: round seed {round_seed}", flush=True)
        argv = [
            sys.executable, "-m", "pytest", "tests/integration/chaos", "-p", "no:randomly",
            "-x", "-q", "-m", "slow", "--timeout", "900", *extra,
        ]  # fmt: skip
        env = {**os.environ, "CHAOS_SEED": str(round_seed), "CHAOS_LONG": "1"}
        code = subprocess.call(argv, cwd=ROOT, env=env)
        if code != 0:
            print(
                f"\nchaos round {rounds} FAILED (exit {code}). Replay this round with:\n"
                f"  CHAOS_SEED={round_seed} CHAOS_LONG=1 {shlex.join(argv[:4])} -p no:randomly"
                f"\nor the whole run with: CHAOS_SEED={seed} make chaos",
                flush=True,
            )
            return code
        if time.monotonic() >= deadline:
            break
    took = (time.monotonic() - started) / 60
    print(f"\nchaos: {rounds} round(s) passed in {took:.1f} min, CHAOS_SEED={seed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
