"""score-worker's Kafka side: settings, batching, offset tracking, the worker loop, the command line.

Kept free of heavy imports so that `import worker` (and `score-worker --help`) stays cheap; import the
parts from their modules: `worker.config.WorkerSettings`, `worker.app.ScoreWorker`,
`worker.broker.EmbeddedBroker`, `worker.client.ScoreClient`.
"""
