"""``python -m pdist.course handout DIR``: write the student copy of the course (pdist/course/handout.py)."""
import sys

USAGE = "usage: python -m pdist.course handout DIR"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "handout":
        raise SystemExit(USAGE + "   (write the student copy: exercises blank, no reference answers)")
    from pdist.course.handout import main as handout
    return handout(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
