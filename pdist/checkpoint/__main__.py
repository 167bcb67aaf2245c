"""``python -m pdist.checkpoint verify DIR | inspect DIR | consolidate DIR OUT``."""
import sys

from pdist.checkpoint.sharded import main

sys.exit(main())
