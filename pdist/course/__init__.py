"""The course: the lessons' helpers and the exercises' autograder (docs/course.md).

    lesson.py       flags, tables, the PASS/FAIL line and the references every lesson uses
    summary.py      the lessons' JSON summary, written atomically as strict JSON
    grade.py        the autograder (``python -m pdist.grade``, ``make grade``): one exercise, the CLI
    classroom.py    class mode (``--class``): parallel, with progress, CSV or JSON
    screening.py    what is checked before a launch: bad files, misnamed, the library's answer
    channel.py      the graded job's signed report channel
    verdict.py      a graded run's verdict from its signed reports
    checks*.py      each exercise's checks, run under mpiexec
    handout.py      the student copy (``make handout DIR=...``, ``python -m pdist.course handout DIR``)
    common.py       what the checks share
    solutions.py    the library's own answers (``--reference``)
"""
