"""`python -m picotron.plan ...`: the command line (picotron.plan.cli)."""
import sys

from picotron.plan.cli import main

sys.exit(main())
