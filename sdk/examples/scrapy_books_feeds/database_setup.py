"""The setup step the project's README says to run before crawling: creates books.db."""
import sqlite3

db = sqlite3.connect("books.db")
db.execute("CREATE TABLE IF NOT EXISTS books (sku TEXT PRIMARY KEY, title TEXT, price REAL)")
db.commit()
db.close()
print("database ready: books.db")
