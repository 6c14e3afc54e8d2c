"""datagen workers: the Celery app (``workers.celery``), its task and the sample's path.

Importing the package builds nothing; ``celery -A workers worker`` finds the app in
``workers/celery.py`` by Celery's own convention.
"""
