"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``: the request
checked (``request``), the JSON objects sent back (``objects``), engine results as a whole
message or its events (``reply``), and the routes (``routes``)."""
