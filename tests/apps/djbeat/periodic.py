"""Edit the schedule in the database as the admin would:
``python -m tests.apps.djbeat.periodic add NAME SECONDS`` or ``disable NAME``."""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.djbeat.settings")
    import django  # noqa: PLC0415 - configured above

    django.setup()
    from django_celery_beat.models import IntervalSchedule, PeriodicTask  # noqa: PLC0415

    command, name, *rest = argv
    if command == "add":
        every, _ = IntervalSchedule.objects.get_or_create(
            every=int(rest[0]), period=IntervalSchedule.SECONDS
        )
        PeriodicTask.objects.create(name=name, task="djbeat.tick", interval=every)
    elif command == "disable":
        task = PeriodicTask.objects.get(name=name)
        task.enabled = False
        task.save()
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
