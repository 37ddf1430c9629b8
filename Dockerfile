FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY orchestrator orchestrator
COPY tasks tasks
COPY transport transport
RUN pip install --no-cache-dir ".[ops]"
ENV REDIS_URL=redis://redis:6379/0
