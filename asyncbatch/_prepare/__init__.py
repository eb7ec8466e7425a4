"""``prepare``: a raw corpus (JSONL, Parquet, text files; any store) into a documents dataset.

The work is cut into units decided from the inputs alone (:mod:`.inputs`); each unit reads its
records (:mod:`.records`), tokenizes them (:mod:`.tokenizer`) and writes its own shards, their
indexes and, last, a done record (:mod:`.unit`). The units run in a local process pool or as
Ray tasks (:mod:`.engines`); the driver (:mod:`.driver`) skips units whose done record checks
out and writes the manifest from the records, last. Importing this package loads nothing.
"""
