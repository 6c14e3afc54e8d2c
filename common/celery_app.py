"""The Celery app and its options, the same in every process.

Producer, workers, the CLI and Flower all build their app here, so they share one
visibility timeout: the Redis transport lets any consumer sweep unacked messages older
than *its own* timeout back into the queue, and a shorter value anywhere would run live
tasks twice.
"""

from __future__ import annotations

import ssl
from typing import Any

from celery import Celery
from celery.app.amqp import AMQP
from kombu import Connection

from common.keys import AHEAD_PRIORITY, KOMBU_UNACKED, KOMBU_UNACKED_INDEX, PROMPT_PRIORITY
from common.settings import Settings


def broker_ssl(url: str) -> dict[str, Any] | None:
    """Celery's ``broker_use_ssl`` for ``url``: the server's certificate checked.

    kombu's Redis transport turns TLS on for a ``rediss://`` URL by itself, but without
    these options it does not verify the server (it warns, and uses ``CERT_NONE``). The
    URL's own ``ssl_*`` parameters still win: kombu reads them over these."""
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED} if url.startswith("rediss://") else None


def celery_config(settings: Settings) -> dict[str, Any]:
    return {
        "broker_url": settings.redis_url,
        "broker_use_ssl": broker_ssl(settings.redis_url),
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
            # kombu 5.7: sweep for expired unacked messages every 10 s instead of ~100 s.
            "unacked_restore_interval": 10,
            "unacked_restore_throttle": 1,
            "queue_order_strategy": "round_robin",
            # Two steps: a conversation's next turns (priority 0, the queue's own list)
            # ahead of new prompts (3), common/messages.py. Steps 6 and 9 would stay empty
            # and a worker's BRPOP would name them in vain. Purges still clear all four.
            "priority_steps": [AHEAD_PRIORITY, PROMPT_PRIORITY],
            # Named, though they are kombu's defaults: the reaper and the audit read these
            # two keys (workers/liveness.py, common/audit.py).
            "unacked_key": KOMBU_UNACKED,
            "unacked_index_key": KOMBU_UNACKED_INDEX,
            "socket_timeout": 30,
            "socket_connect_timeout": 5,
            "health_check_interval": 25,
        },
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # Results live in SQL; a result backend would cost a subscription per task.
        "task_ignore_result": True,
        "result_backend": None,
        "task_acks_late": True,
        "worker_prefetch_multiplier": 1,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "task_create_missing_queues": True,
        "task_default_queue": "datagen.default",
        "worker_send_task_events": False,
        "worker_hijack_root_logger": False,
        # The workers' threads pool cannot cancel a running task: at a connection loss
        # Celery would only log a traceback per task in flight. Those tasks finish, and the
        # copies Redis puts back find their samples settled (docs/ARCHITECTURE.md).
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_pool_limit": max(10, settings.threads + 4),
    }


class _Connection(Connection):
    """kombu's connection, whose URL for logs shows ``:**@`` only when there is a password.

    kombu masks the password field whatever it holds, so a broker without one was shown
    as ``redis://:**@host``, as if one were set (Celery's banner and its "Connected to")."""

    def as_uri(self, include_password: bool = False, mask: str = "**",
               *args: Any, **kwargs: Any) -> str:
        uri = str(super().as_uri(include_password, mask, *args, **kwargs))
        if not include_password and not self.password:
            uri = uri.replace(f":{mask}@", "", 1) if not self.userid else \
                uri.replace(f":{mask}@", "@", 1)
        return uri


class _AMQP(AMQP):
    Connection = _Connection


def make_celery(settings: Settings, main: str = "datagen") -> Celery:
    app = Celery(main, set_as_current=False, amqp=_AMQP)
    app.conf.update(celery_config(settings))
    return app
