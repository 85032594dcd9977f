"""`python -m probserve`: the `probserve` command."""

import sys

from probserve.cli import main

sys.exit(main())
