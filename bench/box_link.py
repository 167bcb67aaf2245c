"""The emulated cluster's link, measured: alpha (8 B ping-pong) and the rate of 24 MiB streamed in
1 MiB messages from node 1 to node 2, one rank per node, under the box's MPI.

    python -m pdist.cluster --nodes 2 --ranks-per-node 1 -- python bench/box_link.py
    python -m pdist.cluster --nodes 2 --ranks-per-node 1 --link-gbps 1 -- python bench/box_link.py
"""
import os
import runpy
import sys

sys.argv = [sys.argv[0], "link"]
runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "tests", "workers", "box_cases.py"), run_name="__main__")
