"""Demo Scrapy project for CrawlerKeeper: crawls the dev master's demo shop."""
