"""Seeds: the untrusted entries pushed to ``<spider>:start_urls``, parsed, validated and read in batches
by the spiders and ``scrapy-dist push``.

May import: ``settings``, ``redis``, ``wire``, ``utils`` and the root's exceptions.
"""
