"""`python -m benchmarks [SCENARIO] [--quick]`: the harness, from a checkout (same as `bus bench`)."""

from __future__ import annotations

import sys

from rich.console import Console

from benchmarks.harness import main

if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--quick"]
    sys.exit(main(args[0] if args else None, quick="--quick" in sys.argv[1:], console=Console()))
