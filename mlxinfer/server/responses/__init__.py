"""OpenAI's Responses API, ``/v1/responses``: the request checked (``request``, its ``input``
items as chat messages in ``inputs``), engine results as a ``response`` or its events
(``reply``), and the route (``routes``)."""
