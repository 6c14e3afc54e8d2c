# syntax=docker/dockerfile:1
# The datagen app image: producer, workers, Flower, the simulator and the CLI.
# docker-compose.yml gives each service its full command (`datagen worker ...`,
# `celery -A workers flower ...`), so there is no ENTRYPOINT to prepend to them.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The runtime dependencies first, read from pyproject.toml alone. Changing the code then
# doesn't reinstall them. No dev extras.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# README* copies nothing, rather than failing, if the README is absent.
COPY README* ./
COPY common ./common
COPY producer ./producer
COPY workers ./workers
COPY ops ./ops
COPY examples ./examples
RUN pip install --no-deps . && rm -rf build ./*.egg-info

# Runs as an unprivileged user, and the code in /app is root-owned, so it stays read-only.
# /app/common/assets/tokenizer is the bundled tokenizer (DATAGEN_TOKENIZER's default in
# compose).
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/datagen datagen
USER datagen

CMD ["datagen", "--help"]
