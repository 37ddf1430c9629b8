"""The worker side of rlship: the Celery app (`celery -A tasks worker`) and the ship-path
stages, each a pure function in `tasks.stages` called by its task in `tasks.ship`, in the
order `tasks.graph` declares, through the one seam `tasks.context.stage_task`."""

from tasks.app import app

__all__ = ["app"]
