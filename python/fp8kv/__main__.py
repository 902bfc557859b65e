"""`python -m fp8kv`: see fp8kv.cli."""

import sys

from .cli import main

sys.exit(main())
