"""The statements of the compaction job (`sql.py`) and the bulk loader of synthetic history (`bulk.py`).

The job itself, a PySpark driver, lives in `bus.compaction`.
"""
