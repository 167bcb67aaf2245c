"""``python -m pdist.train`` (pdist/train/run.py)."""
import sys

from pdist.train.run import main

sys.exit(main())
