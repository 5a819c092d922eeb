"""The fault catalogue's bench: `parity check --faults` with its knobs (commands/check/faults.py).

python -m bench.faults [--steps 4] [--inject_version 2] [--threshold 1e-6] [--seed 0] [--out DIR]
"""

import sys

from commands.check.faults import main

if __name__ == "__main__":
    sys.exit(main())
