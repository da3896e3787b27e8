"""`python -m worker`: the same as the `score-worker` command."""

from worker.cli import main

raise SystemExit(main())
