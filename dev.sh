#!/usr/bin/env bash
# One entry point for a fresh machine: builds .venv on first use, then runs the demo or the test suite.
#   ./dev.sh demo   - embedded broker + tiny local model + one worker + sample requests, results printed
#   ./dev.sh test   - the whole suite: ruff, mypy and pytest against a real (embedded) broker and a real
#                     Prometheus (installed with apt-get when missing and run as root)
#   ./dev.sh lock   - resolve the dev install afresh and write the pins to constraints.txt
set -euo pipefail
cd "$(dirname "$0")"

VENV="${SCORE_WORKER_VENV:-.venv}"
PY="${PYTHON:-python3}"

# The test suite runs a real Prometheus (and promtool) and checks docker-compose.yml with a real compose
# implementation; on Debian/Ubuntu both come from apt. Elsewhere the tests that need them say how to get them.
system_tools() {
    if command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v docker-compose >/dev/null; then
        return
    fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "dev.sh: installing prometheus and docker-compose with apt-get" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus docker-compose >/dev/null
    else
        echo "dev.sh: prometheus/promtool or docker-compose missing; install them (apt-get install prometheus docker-compose) or their tests will not run" >&2
    fi
}

# The versions the suite runs with: every install here (and the Dockerfile's) takes constraints.txt, while
# pyproject.toml keeps the ranges users may install. `./dev.sh lock` writes it anew.
CONSTRAINTS=constraints.txt
TORCH_VERSION=2.13.0

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

cmd="${1:-}"
shift || true
case "$cmd" in
    demo)
        setup
        exec "$VENV/bin/score-worker" demo "$@"
        ;;
    test)
        setup
        system_tools
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    setup)
        setup
        ;;
    lock)
        lock
        ;;
    *)
        echo "usage: ./dev.sh demo|test|setup|lock [args...]" >&2
        exit 2
        ;;
esac
