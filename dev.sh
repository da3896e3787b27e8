#!/usr/bin/env bash
# One entry point for a fresh machine: builds .venv on first use, then runs the demo or the test suite.
#   ./dev.sh demo   - embedded broker + tiny local model + one worker + sample requests, results printed
#   ./dev.sh test   - the whole suite: ruff, mypy and pytest against a real (embedded) broker and a real
#                     Prometheus (installed with apt-get when missing and run as root)
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

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    local stamp="$VENV/.installed"
    # Reinstall only when the dependency list changed: keeps repeated runs fast.
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        "$VENV/bin/python" -m pip install -q --upgrade pip
        # torch first and pinned: the CPU build lies on the development machines' disk, while a bare
        # "torch" requirement would pull a multi-GB CUDA build. Any torch >= 2.11 already present is kept.
        if ! "$VENV/bin/python" -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
            "$VENV/bin/python" -m pip install -q "torch==2.13.0"
        fi
        "$VENV/bin/python" -m pip install -q -e '.[dev]'
        touch "$stamp"
    fi
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
    *)
        echo "usage: ./dev.sh demo|test|setup [args...]" >&2
        exit 2
        ;;
esac
