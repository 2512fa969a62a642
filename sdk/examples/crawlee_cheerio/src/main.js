// crawlee's CheerioCrawler template, unchanged in shape: the items go to the default dataset
// (storage/datasets/default/*.json), which ckagent reads into the task's items by convention.
// The start URL comes from the task's params (CK_PARAMS.start_url) or START_URL.
import { CheerioCrawler, Dataset } from "crawlee";

const params = JSON.parse(process.env.CK_PARAMS || "{}");
const startUrl = params.start_url ?? process.env.START_URL ?? "http://127.0.0.1:8080/demo-site/";

const crawler = new CheerioCrawler({
  maxRequestsPerCrawl: 50,
  maxConcurrency: 1, // one page at a time: the dataset's order is the shop's order
  async requestHandler({ $, request, enqueueLinks, log }) {
    log.info(`listing ${request.loadedUrl}`);
    const products = $("ul.products li.product")
      .map((_, el) => ({
        title: $(el).find("a.title").text().trim(),
        price: Number($(el).find("span.price").text()),
        sku: $(el).find("span.sku").text().trim(),
        url: new URL($(el).find("a.title").attr("href"), request.loadedUrl).href,
      }))
      .get();
    for (const product of products) {
      await Dataset.pushData(product);
    }
    await enqueueLinks({ selector: "a.next" });
  },
});

await crawler.run([startUrl]);
