"""The HTTP gateway: calls in the shapes users already send (SGLang, vLLM, rerank, OpenRLHF) as score requests
on Kafka, each gateway reading its results from a reply topic of its own (docs/usage.md, "From HTTP")."""
