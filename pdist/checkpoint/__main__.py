"""``python -m pdist.checkpoint verify DIR | inspect DIR | consolidate DIR OUT``."""
import sys

from pdist.checkpoint.cli import main

sys.exit(main())
