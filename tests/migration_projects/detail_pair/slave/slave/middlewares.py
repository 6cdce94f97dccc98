import random


class AgentMiddleware:
    """A User-Agent from AGENT_POOL for every request."""

    def __init__(self, agents):
        self.agents = agents

    @classmethod
    def from_crawler(cls, crawler):
        return cls(crawler.settings.getlist("AGENT_POOL"))

    def process_request(self, request, spider):
        request.headers["User-Agent"] = random.choice(self.agents)
