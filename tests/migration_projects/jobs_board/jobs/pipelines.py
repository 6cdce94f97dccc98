import datetime


class CrawledPipeline:
    def process_item(self, item, spider):
        item["crawled"] = datetime.date.today().isoformat()
        return item
