"""The stores behind the seam of :mod:`celery_redlock.core.store`."""
