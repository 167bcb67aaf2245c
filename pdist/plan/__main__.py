"""``python -m pdist.plan``: the planner's command line (pdist/plan/cli.py)."""
import sys

from pdist.plan.cli import main

sys.exit(main())
