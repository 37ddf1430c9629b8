"""The worker side of rlship: the Celery app (`celery -A tasks worker`) and the ship-path
stages, each a pure function in `tasks.stages` wrapped by a thin task in `tasks.ship`."""

from tasks.app import app

__all__ = ["app"]
