"""Demo spider that fails on purpose: shows a FAILED task (exit code 3) in the CrawlerKeeper demo."""

import sys


def main():
    print("fail_demo: starting, about to fail on purpose", flush=True)
    print("something went wrong: demo failure", file=sys.stderr, flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
