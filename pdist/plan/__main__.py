"""``python -m pdist.plan``: the planner's command line (pdist/plan/planner.py)."""
import sys

from pdist.plan.planner import main

sys.exit(main())
