"""The example project's spiders: ``demo`` (the generated local site of ``scrapy-dist demo``) and
``books`` (books.toscrape.com, for a try on a real site)."""
