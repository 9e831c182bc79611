"""OpenAI's API: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``: the
request checked (``request``), the JSON objects sent back (``objects``), engine results as a
whole response or its events (``reply``), and the routes (``routes``)."""
