"""``scrapy-dist demo``: a generated local site, an embedded Redis and several workers, one killed, with a
report of what was crawled and lost. ``demo.site`` is also the site the tests and benchmarks crawl.

May import anything below ``cli``.
"""
