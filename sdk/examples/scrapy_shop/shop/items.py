# Define here the models for your scraped items
#
# See documentation in:
# https://docs.scrapy.org/en/latest/topics/items.html

import scrapy


class ProductItem(scrapy.Item):
    title = scrapy.Field()
    price = scrapy.Field()
    sku = scrapy.Field()
    url = scrapy.Field()
    description = scrapy.Field()
    page = scrapy.Field()
    crawled_by = scrapy.Field()
