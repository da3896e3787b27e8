"""The topics' default names, the same for every side of the wire: workers, clients, tools, the stack."""

from __future__ import annotations

REQUESTS_TOPIC = "score.requests"
RESULTS_TOPIC = "score.results"
DLQ_TOPIC = "score.requests.dlq"
