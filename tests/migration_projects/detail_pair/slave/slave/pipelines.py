import json

from slave.redisutil import connect


class ContactPipeline:
    """Stores every contact as a JSON row (the original wrote to MySQL) and marks its page complete."""

    def open_spider(self, spider):
        self.conn = connect(spider.settings)

    def close_spider(self, spider):
        self.conn.close()

    def process_item(self, item, spider):
        self.conn.rpush("contacts", json.dumps(dict(item), ensure_ascii=False))
        self.conn.sadd("completeurl:", item["url"])
        return item
