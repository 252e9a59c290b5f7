"""`python -m opport ...`: the `opport` command without an installed entry point (e.g. PYTHONPATH=. on a lent GPU)."""

import sys

from opport.cli import main

sys.exit(main())
