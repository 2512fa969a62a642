import crawlerkeeper_sdk as ck

if __name__ == "__main__":
    ck.save_item({"price": 10})
