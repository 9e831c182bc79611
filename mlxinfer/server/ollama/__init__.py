"""Ollama's API, under ``/api``: the request checked (``request``), the reply whole or as NDJSON
(``reply``), the JSON objects (``objects``), and the routes (``routes``)."""
