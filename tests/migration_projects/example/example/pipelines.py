from datetime import datetime, timezone


class StampPipeline:
    """Adds when and by which spider an item was scraped (the example project's pipeline)."""

    def process_item(self, item, spider):
        item["crawled"] = datetime.now(timezone.utc).isoformat()
        item["spider"] = spider.name
        return item
