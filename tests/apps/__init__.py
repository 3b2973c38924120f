"""Small Celery apps that subprocess tests run with ``celery -A tests.apps.<module>``."""
