"""How long a requeued run's key is kept for its copy depends on when the broker hands an
unacknowledged message out again: the visibility timeout, read without connecting."""

from __future__ import annotations

from celery import Celery

from celery_redlock.worker.bootstep import redelivery_wait


def _app(broker: str, **conf: object) -> Celery:
    app = Celery("redelivery", broker=broker, set_as_current=False)
    app.conf.update(conf)
    return app


def test_the_visibility_timeout_is_the_brokers_setting_else_its_transports_default() -> None:
    """broker_transport_options["visibility_timeout"] when set; else the Redis transport's
    own default (an hour); AMQP hands a message back when its channel closes (0); nothing
    here connects (the ports are closed)."""
    redis_broker = "redis://127.0.0.1:1/0"
    assert redelivery_wait(_app(redis_broker)) == 3600.0
    options = {"visibility_timeout": 42}
    assert redelivery_wait(_app(redis_broker, broker_transport_options=options)) == 42.0
    assert redelivery_wait(_app("amqp://guest:guest@127.0.0.1:1//")) == 0.0
    assert redelivery_wait(_app("memory://")) == 0.0
    bad = {"visibility_timeout": "soon"}
    assert redelivery_wait(_app(redis_broker, broker_transport_options=bad)) == 0.0
