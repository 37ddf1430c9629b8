# One image for every rlship process in compose.yaml: Celery workers, Flower, the orchestrator,
# the producer and the trainer ranks (the service's command picks which).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY rlship rlship
COPY orchestrator orchestrator
COPY tasks tasks
COPY transport transport
RUN pip install --no-cache-dir ".[ops,tracing]"
ENV REDIS_URL=redis://redis:6379/0
CMD ["rlship", "--help"]
