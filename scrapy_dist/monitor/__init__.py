"""Reading a running crawl from outside: ``status``, the filter's figures, the Prometheus exporter and the
dashboard (with its static files).

May import: ``settings``, ``redis``, ``wire``, ``dupefilter``, ``frontier``, ``utils``; nothing imports it
but ``cli``.
"""
