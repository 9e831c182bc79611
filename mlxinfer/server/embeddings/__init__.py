"""OpenAI's embeddings API, ``/v1/embeddings``: the request checked (``request``), the list of
vectors sent back (``reply``), and the route (``routes``)."""
