"""Talking to Redis: which server (``REDIS_URL``, the embedded default), the clients built for it, the one
outage policy, the crawl's key names, the Lua scripts and how untrusted replies are read. May import:
``settings``, ``utils`` and the root's exceptions; nothing above it."""
