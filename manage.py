#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "wfdash.settings")
    from django.core.management import execute_from_command_line

    from workflows_app.schema import refuse_unreachable_database

    # migrate, createsuperuser…: an unreachable PostgreSQL is one line in seconds.
    refuse_unreachable_database(sys.argv)
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
