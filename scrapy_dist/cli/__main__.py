"""``python -m scrapy_dist.cli``: the same as the ``scrapy-dist`` command (for a venv not on PATH)."""

from scrapy_dist.cli import main

if __name__ == "__main__":
    main()
