"""The course: the lessons' helpers and the exercises' autograder (docs/course.md).

    lesson.py       flags, tables, the PASS/FAIL line and the references every lesson uses
    summary.py      the lessons' JSON summary, written atomically as strict JSON
    grade.py        the autograder (``python -m pdist.grade``, ``make grade``)
    checks*.py      each exercise's checks, run under mpiexec
    handout.py      the student copy (``make handout DIR=...``, ``python -m pdist.course handout DIR``)
    common.py       what the checks share
    solutions.py    the library's own answers (``--reference``)
"""
