"""The results store: `--store results.db` appends runs to SQLite; `opport history` and `opport report` read it
(docs/store.md). `db` is the storage layer and imports nothing of conformance or bench, which write through it;
`history` and `html` are commands and sit with the cli."""
