# The spiders of the bookscraper project.
