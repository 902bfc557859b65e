"""`python -m fp8kv`: see fp8kv.cli."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m fp8kv"))
