"""A module no test imports: a task name that points into it must not import it
(tests/test_tasks.py)."""

IMPORTED = True
