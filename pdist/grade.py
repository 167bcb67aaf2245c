"""``python -m pdist.grade``: the course's autograder (pdist/course/grade.py)."""
import sys

from pdist.course.grade import main

if __name__ == "__main__":
    sys.exit(main())
