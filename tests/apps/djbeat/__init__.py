"""A Django project with django-celery-beat (``settings``, ``celery``, ``periodic``): two
beats share its SQLite file, and ``LeaderScheduler`` leads ``DatabaseScheduler``."""
