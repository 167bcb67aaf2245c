import sys

from pdist.cluster.cli import main

sys.exit(main())
