#!/usr/bin/env bash
# One entry point for a fresh machine: builds .venv on first use, then runs the demo or the test suite.
#   ./dev.sh demo   - embedded broker + tiny local model + one worker + sample requests, results printed
#   ./dev.sh test   - the whole suite: the static checks (./dev.sh lint), then pytest against Apache Kafka
#                     (run from its jars; Java and Maven, Prometheus and docker-compose installed with
#                     apt-get when missing, as root), in three processes or $SCORE_WORKER_TEST_PROCESSES;
#                     arguments go to pytest: `./dev.sh test -m fast` is the edit loop's tier
#   ./dev.sh lint   - the static checks alone: ruff (lint, format), mypy, the import layering contract
#   ./dev.sh kafka  - Apache Kafka in the foreground (--nodes 3 for a cluster), for trials and own runs
#   ./dev.sh lock   - resolve the dev install afresh and write the pins to constraints.txt
set -euo pipefail
cd "$(dirname "$0")"

VENV="${SCORE_WORKER_VENV:-.venv}"
PY="${PYTHON:-python3}"

# The test suite runs Apache Kafka from its jars (Java 17+, and Maven the first time, to resolve them), on
# network namespaces (iproute2) for the broker-failure tests, kcat as a client, a real Prometheus (and
# promtool), and checks docker-compose.yml with a real compose implementation; on Debian/Ubuntu all come
# from apt. Elsewhere the tests that need them say how to get them.
system_tools() {
    local missing=()
    command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    java_ok || missing+=(default-jre-headless)
    command -v mvn >/dev/null || missing+=(maven)
    command -v kcat >/dev/null || missing+=(kcat)           # a peer of the worker in the client tests
    command -v ip >/dev/null || missing+=(iproute2)         # a network namespace per Kafka node
    if [ ${#missing[@]} = 0 ]; then
        return
    fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "dev.sh: installing ${missing[*]} with apt-get" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "dev.sh: ${missing[*]} missing; install them (apt-get install ${missing[*]}) or their tests will not run" >&2
    fi
}

# Java 17 or newer, as $JAVA_HOME's or on PATH (what Kafka 4 needs).
java_ok() {
    local java="${JAVA_HOME:+$JAVA_HOME/bin/}java"
    command -v "$java" >/dev/null || return 1
    local major
    major=$("$java" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
    [ -n "$major" ] && [ "$major" -ge 17 ]
}

# Kafka's jars for every version the suite runs (deploy/kafka/pom.xml), resolved once into the cache.
kafka_jars() {
    if java_ok; then
        "$VENV/bin/score-worker" kafka --resolve-only >&2 || echo "dev.sh: Kafka's jars could not be resolved" >&2
    fi
}

# The versions the suite runs with: every install here (and the Dockerfile's) takes constraints.txt, while
# pyproject.toml keeps the ranges users may install. `./dev.sh lock` writes it anew.
CONSTRAINTS=constraints.txt
TORCH_VERSION=2.13.0
# OpenRLHF's own remote-reward client runs against the gateway in the suite. The package's dependencies are
# DeepSpeed, flash-attn, Ray and vLLM builds; its client needs none of them (aiohttp, in [dev]), so it is
# installed without them, into a directory of its own off the path: its wheel also carries a top-level
# `tests` package, which would hide this repository's.
OPENRLHF_VERSION=0.11.2

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    local stamp="$VENV/.installed"
    # Reinstall only when the dependency list or the pins changed: keeps repeated runs fast.
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$CONSTRAINTS" -nt "$stamp" ]; then
        "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" --upgrade pip
        # torch first and pinned, PyPI's build or a CPU build found beside it (pip's find-links or
        # index): both are "torch==2.13.0" to pip, and the pins hold for either.
        "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
        "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e '.[dev]'
        "$VENV/bin/python" -m pip install -q --no-deps --upgrade --target "$VENV/openrlhf" "openrlhf==$OPENRLHF_VERSION"
        touch "$stamp"
    fi
}

# Resolves the dev install afresh in a scratch venv and writes what it took to constraints.txt.
lock() {
    local scratch
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' RETURN
    "$PY" -m venv "$scratch/venv"
    "$scratch/venv/bin/python" -m pip install -q --upgrade pip
    "$scratch/venv/bin/python" -m pip install -q "torch==$TORCH_VERSION" -e '.[dev]'
    {
        echo "# What the suite was run with: ./dev.sh and the Dockerfile install with -c constraints.txt."
        echo "# Written by ./dev.sh lock ($("$scratch/venv/bin/python" --version), $(uname -m)); do not edit by hand."
        echo "# torch==$TORCH_VERSION also admits the CPU build (2.13.0+cpu); its CUDA packages are then not needed."
        "$scratch/venv/bin/python" -m pip freeze --all --exclude-editable | grep -v '^score-worker'
    } >"$CONSTRAINTS"
    echo "dev.sh: wrote $CONSTRAINTS ($(grep -c '==' "$CONSTRAINTS") pins)" >&2
}

# The static checks, each its own step, before any test runs: ruff's lint and format check everywhere, mypy
# on the packages (files and strictness in pyproject.toml), and the layering contract of [tool.importlinter]
# (schemas <- models <- worker, no import circle inside a package).
lint() {
    local bin="$VENV/bin"
    echo "dev.sh: ruff check" >&2
    "$bin/ruff" check .
    echo "dev.sh: ruff format --check" >&2
    "$bin/ruff" format --check .
    echo "dev.sh: mypy" >&2
    "$bin/mypy" --no-error-summary
    echo "dev.sh: lint-imports" >&2
    "$bin/lint-imports" --no-cache
}

cmd="${1:-}"
shift || true
case "$cmd" in
    demo)
        setup
        exec "$VENV/bin/score-worker" demo "$@"
        ;;
    test)
        setup
        lint
        system_tools
        kafka_jars
        # Three processes unless SCORE_WORKER_TEST_PROCESSES says otherwise (0: one; pytest-xdist, each
        # test file whole in one, the fault files first). Three on two cores: much of the suite waits on
        # brokers and worker processes rather than the CPU. The fault tests measure against what their
        # producers sent, not against a clock, so slowed processes make them longer, not wrong.
        # Each process (and every worker process a test starts) gets its share of the cores for torch's
        # threads: more threads than cores spin against each other and slow every test down.
        processes="${SCORE_WORKER_TEST_PROCESSES:-3}"
        threads=$(( $(nproc) / (processes > 0 ? processes : 1) ))
        export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
        # --no-loadscope-reorder: pytest-xdist (3.6 on) would otherwise hand out the files by their number of
        # tests, most first, which left the fault files (few tests, minutes each) to the end of the run
        # instead of the order tests/conftest.py gives them (longest first).
        exec "$VENV/bin/python" -m pytest -n "$processes" --dist loadfile --no-loadscope-reorder "$@"
        ;;
    lint)
        setup
        lint
        ;;
    kafka)
        setup
        exec "$VENV/bin/score-worker" kafka "$@"
        ;;
    setup)
        setup
        ;;
    lock)
        lock
        ;;
    *)
        echo "usage: ./dev.sh demo|test|lint|kafka|setup|lock [args...]" >&2
        exit 2
        ;;
esac
