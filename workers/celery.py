"""The worker app that ``celery -A workers worker`` and ``datagen worker`` run.

It is built from the environment when this module is imported, and only then: the rest
of ``workers`` can be imported (by tests, benchmarks, the CLI) without reading settings
or building an app. Celery looks for ``workers.celery`` by its own convention.
"""

from common.settings import Settings
from workers.app import create_app

app = create_app(Settings.from_env())
