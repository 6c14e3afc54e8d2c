# One command per check, the same locally and in CI.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck compose-check bench reliability clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,test-hf]'
	touch $(STAMP)

install: $(STAMP)

## The main job end to end on embedded defaults (simulator, SQLite, Redis started if absent).
demo: $(STAMP)
	$(VENV)/bin/datagen demo

## The whole test suite, on the real Redis, PostgreSQL and SQLite: TEST_WORKERS pytest-xdist
## workers, each with a Redis DB and a PostgreSQL database of its own (tests/isolation.py)
## and a test file's tests on one worker; then the tests marked `serial`, alone.
# pytest exits 5 when it collects no test: that is a failure too, in either pass.
TEST_WORKERS ?= 4
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial"; parallel=$$?; \
	$(PY) -m pytest -m serial; serial=$$?; \
	for status in $$parallel $$serial; do \
	  if [ $$status -eq 5 ]; then echo "make test: a pass collected no test" >&2; exit 1; fi; \
	done; \
	if [ $$parallel -ne 0 ]; then exit $$parallel; fi; \
	exit $$serial

lint: $(STAMP)
	$(VENV)/bin/ruff check .

## docker-compose.yml as Compose reads it (needs Debian's docker-compose, no engine).
compose-check:
	docker-compose --env-file .env.example -f docker-compose.yml config -q

## Benchmarks (prints tables; writes nothing in the repo): see docs/PERFORMANCE.md.
bench: $(STAMP)
	$(PY) -m bench

## Fault scenarios at scale; rewrites docs/RELIABILITY.md.
reliability: $(STAMP)
	$(PY) -m bench.reliability

typecheck: $(STAMP)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache datagen.db datagen.db-*
